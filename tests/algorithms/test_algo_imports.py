"""The public names exist, and importing openppo.algorithms pulls in no heavy backend."""

import subprocess
import sys

import openppo.algorithms as algorithms


def test_import_pulls_no_backend():
    code = (
        "import openppo.algorithms, sys; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('ray', 'deepspeed', 'vllm')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_names_and_tuples():
    for name in algorithms.__all__:
        assert hasattr(algorithms, name), name
    assert algorithms.ADVANTAGE_ESTIMATORS == (
        "gae",
        "reinforce",
        "rloo",
        "reinforce_baseline",
        "group_norm",
        "dr_grpo",
    )
    assert algorithms.KL_ESTIMATORS == ("k1", "k2", "k3")
    assert algorithms.POLICY_LOSS_TYPES == ("ppo", "gspo", "cispo")
    assert algorithms.IS_CORRECTION_TYPES == ("tis", "icepop", "seq-mask-tis", "token-trunc", "seq-mask", "geo-mask")


def test_default_aggregation_per_estimator():
    expected = {
        "gae": "token-mean",
        "reinforce": "token-mean",
        "rloo": "token-mean",
        "reinforce_baseline": "token-mean",
        "group_norm": "token-mean",
        "dr_grpo": "seq-mean-token-sum-norm",
    }
    for estimator, mode in expected.items():
        assert algorithms.default_loss_agg_mode(estimator) == mode
        assert algorithms.default_loss_agg_mode(estimator, "gspo") == "seq-mean-token-mean"
    assert algorithms.needs_critic("gae") and not algorithms.needs_critic("group_norm")
    assert [e for e in algorithms.ADVANTAGE_ESTIMATORS if algorithms.whitens_by_default(e)] == [
        "gae",
        "reinforce",
        "reinforce_baseline",
    ]
