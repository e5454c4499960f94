"""The engine worker's reload-warning filter: vLLM's "Failed to load weights" lines of one sync are taken out of the
log and counted by layer class, except those that every sync has by design (rotary caches, a tied LM head)."""

from __future__ import annotations

import logging


def test_reload_warnings_are_counted_not_logged():
    from openppo.rollout.worker_extension import _RELOAD_LOGGER, _ReloadWarnings

    def record(*args, msg="%s: Failed to load weights"):
        return logging.LogRecord(_RELOAD_LOGGER.name, logging.WARNING, __file__, 1, msg, args, None)

    warnings = _ReloadWarnings()
    layers = ["LayerNorm", "RotaryEmbedding", "ParallelLMHead", "LayerNorm", "Conv2dLayer", "Llama3RotaryEmbedding"]
    assert not any(warnings.filter(record(layer)) for layer in layers)
    assert warnings.kept == {"LayerNorm": 2, "Conv2dLayer": 1}
    assert warnings.filter(record("QKVParallelLinear", msg="%s: Delayed processing"))  # other lines pass
    assert warnings.filter(record(msg="Failed to load weights"))  # no layer named: not vLLM's line, kept
