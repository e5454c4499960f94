"""Bad input: one line on stderr naming the flag, exit code 2, nothing written to --save_path.

The CLIs validate before starting a process group, Ray or a server, so they run in-process here (fast); a bad
input that got past validation would reach one of those, which the `no_launch` fixture turns into a failure.
"""

from __future__ import annotations

import importlib

import pytest

from openppo.tasks.arithmetic import make_rows
from tests.cli.data import preference_rows, sft_rows
from tests.cli.helpers import REPO, write_jsonl
from tests.model_cache import tiny_model_dir, tiny_vlm_dir


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    (tmp / "adapter").mkdir()  # passes the combiner's up-front check; never loaded
    (tmp / "adapter" / "adapter_config.json").write_text("{}")
    (tmp / "bad.jsonl").write_text('{"input": "1+1", "output": "2"}\n{not json\n')
    (tmp / "no_func.py").write_text("score = 1.0\n")
    (tmp / "a_file").write_text("not a folder\n")
    return {
        "sft": write_jsonl(tmp / "sft.jsonl", sft_rows(8)),
        "pairs": write_jsonl(tmp / "p.jsonl", preference_rows(8)),
        "empty": write_jsonl(tmp / "empty.jsonl", []),
        "model": tiny_model_dir(),
        "vlm": tiny_vlm_dir(),
        "prompts": write_jsonl(tmp / "prompts.jsonl", make_rows(8, seed=1)),
        "long": write_jsonl(tmp / "long.jsonl", [{"input": "word " * 200, "label": "1"}] * 4),
        "reward": REPO / "examples" / "reward_funcs" / "arithmetic.py",
        "no_func": tmp / "no_func.py",
        "bad_json": tmp / "bad.jsonl",
        "file": tmp / "a_file",
        "adapter": tmp / "adapter",
        # a teacher on another tokenizer (Qwen3's whole one: 151,669 tokens against the student's 8192)
        "other_tokenizer": tiny_model_dir(tokenizer="qwen3", num_layers=1),
        "routed": write_jsonl(
            tmp / "routed.jsonl", [{**row, "teacher": "a" if i else "c"} for i, row in enumerate(make_rows(8, seed=1))]
        ),
    }


CASES = [
    # (cli, args (with {sft} {pairs} {model} {empty} placeholders), flag expected in the message)
    ("train_sft", ["--dataset", "/nonexistent/data.jsonl"], "--dataset"),
    ("train_sft", ["--input_key", "question"], "--input_key"),
    ("train_sft", ["--output_key", "answer"], "--output_key"),
    ("train_sft", ["--pretrain", "/nonexistent/model"], "--pretrain"),
    ("train_sft", ["--zero_stage", "4"], "--zero_stage"),
    ("train_sft", ["--param_dtype", "fp16"], "--param_dtype"),
    ("train_sft", ["--train_batch_size", "6", "--micro_train_batch_size", "4"], "--train_batch_size"),
    ("train_sft", ["--dataset", "{empty}"], "--dataset"),
    ("train_sft", ["--max_len", "-5"], "--max_len"),
    ("train_sft", ["--image_key", "images"], "--image_key"),  # a text model has no processor for images
    ("train_sft", ["--pretrain", "{vlm}", "--image_key", "images", "--packing_samples"], "--image_key"),
    ("train_sft", ["--multiturn", "--apply_chat_template_off"], "--multiturn"),
    ("train_sft", ["--input_template", "no placeholder", "--apply_chat_template_off"], "--input_template"),
    ("train_rm", ["--chosen_key", "good"], "--chosen_key"),
    ("train_rm", ["--loss", "hinge"], "--loss"),
    ("train_dpo", ["--ref_pretrain", "/nonexistent/ref"], "--ref_pretrain"),
    ("train_dpo", ["--beta", "0"], "--beta"),
    ("train_sft", ["--ring_attn_size", "2"], "--packing_samples"),
    ("train_dpo", ["--ring_attn_size", "2", "--packing_samples", "--ds_tensor_parallel_size", "2"], "--ring_attn_size"),
    ("train_rm", ["--ds_tensor_parallel_size", "2", "--zero_stage", "3"], "--ds_tensor_parallel_size"),
    ("train_sft", ["--ds_tensor_parallel_size", "2", "--lora_rank", "4"], "--lora_rank"),
    ("lora_combiner", ["--lora_path", "/nonexistent/adapter"], "--lora_path"),
    ("train_sft", ["--dataset", "{bad_json}"], "--dataset"),
    ("train_sft", ["--max_len", "2"], "--max_len"),  # every sample's prompt is longer
    ("train_sft", ["--save_path", "{file}"], "--save_path"),
    ("train_sft", ["--lora_rank", "4", "--lora_dropout", "1.5"], "--lora_dropout"),
    ("train_dpo", ["--lm_head_chunk_tokens", "-1"], "--lm_head_chunk_tokens"),
    ("train_sft", ["--torch_compile", "--zero_stage", "3"], "--torch_compile"),
    ("train_dpo", ["--torch_compile", "--zero_stage", "3"], "--torch_compile"),
    ("train_sft", ["--torch_compile", "--use_liger_kernel"], "--use_liger_kernel with --torch_compile"),
    ("train_rm", ["--dataset", "{empty}"], "--dataset"),
    ("train_rm", ["--train_batch_size", "4", "--micro_train_batch_size", "3"], "--train_batch_size"),
    ("train_dpo", ["--ipo", "--label_smoothing", "0.1"], "--label_smoothing"),
    ("train_dpo", ["--nll_loss_coef", "-1"], "--nll_loss_coef"),
    ("lora_combiner", ["--model_path", "/nonexistent/model"], "--model_path"),
    ("lora_combiner", ["--output_path", "{file}"], "--output_path"),
    # train_ppo_ray: files and keys
    ("train_ppo_ray", ["--prompt_data", "/nonexistent/prompts.jsonl"], "--prompt_data"),
    ("train_ppo_ray", ["--input_key", "question"], "--input_key"),
    ("train_ppo_ray", ["--label_key", "answer"], "--label_key"),
    ("train_ppo_ray", ["--prompt_data", "{empty}"], "--prompt_data"),
    ("train_ppo_ray", ["--prompt_data", "{bad_json}"], "--prompt_data"),
    ("train_ppo_ray", ["--prompt_data", "{long}"], "--prompt_max_len"),  # every prompt is longer than 64 tokens
    ("train_ppo_ray", ["--eval_dataset", "/nonexistent/eval.jsonl"], "--eval_dataset"),
    ("train_ppo_ray", ["--pretrain", "/nonexistent/model"], "--pretrain"),
    ("train_ppo_ray", ["--remote_rm_url", "/nonexistent/reward.py"], "--remote_rm_url"),
    ("train_ppo_ray", ["--remote_rm_url", "{no_func}"], "--remote_rm_url"),
    ("train_ppo_ray", ["--remote_rm_url", "reward.txt"], "--remote_rm_url"),
    ("train_ppo_ray", ["--remote_rm_url_off"], "--remote_rm_url"),  # no reward source at all
    ("train_ppo_ray", ["--agent_func_path", "/nonexistent/agent.py", "--remote_rm_url_off"], "--agent_func_path"),
    ("train_ppo_ray", ["--teacher_pretrain", "/nonexistent/teacher"], "--teacher_pretrain"),
    ("train_ppo_ray", ["--teacher_pretrain", "{other_tokenizer}"], "--teacher_pretrain"),  # another tokenizer
    (
        "train_ppo_ray",
        ["--teacher_pretrain", "{model}", "--remote_rm_url_off", "--distill_task_coef", "1"],
        "--distill_task_coef",
    ),  # no reward to weigh in
    ("train_ppo_ray", ["--teacher_pretrain", "a={model}", "b={model}"], "--teacher_key"),  # two teachers, no route
    (
        "train_ppo_ray",
        ["--teacher_pretrain", "a={model}", "b={model}", "--teacher_key", "teacher", "--prompt_data", "{routed}"],
        "--teacher_key",
    ),  # row 0 names teacher "c"
    ("train_ppo_ray", ["--teacher_pretrain", "a={model}", "a={model}"], "--teacher_pretrain"),  # one name twice
    (
        "train_ppo_ray",
        ["--teacher_pretrain", "{model}", "--remote_rm_url_off", "--dynamic_filtering"],
        "--dynamic_filtering",
    ),
    # (the base run renders its prompts with --apply_chat_template, which an --agent_program run refuses)
    (
        "train_ppo_ray",
        ["--agent_program", "/nonexistent/agent.py", "--apply_chat_template_off"],
        "--agent_program: agent file /nonexistent/agent.py not found",
    ),
    (
        "train_ppo_ray",
        ["--agent_program", "{no_func}", "--apply_chat_template_off"],
        "defines no callable 'agent'",
    ),
    ("train_ppo_ray", ["--agent_program", "python agent.py"], "drop --apply_chat_template"),
    (
        "train_ppo_ray",
        ["--agent_program", "python agent.py", "--agent_func_path", "{no_func}", "--remote_rm_url_off"],
        "--agent_program and --agent_func_path",
    ),
    (
        "train_ppo_ray",
        ["--agent_program", "python agent.py", "--agent_tool_parser", "nope", "--apply_chat_template_off"],
        "--agent_tool_parser nope: vLLM has no such tool parser",
    ),
    (
        "train_ppo_ray",
        ["--agent_program", "python agent.py", "--agent_timeout", "0", "--apply_chat_template_off"],
        "--agent_timeout",
    ),
    ("train_ppo_ray", ["--save_path", "{file}"], "--save_path"),
    ("train_ppo_ray", ["--use_tensorboard", "{file}"], "--use_tensorboard"),
    # train_ppo_ray: batch arithmetic, devices, algorithm, lengths
    ("train_ppo_ray", ["--train_batch_size", "6"], "--train_batch_size"),  # 4 prompts x 4 samples = 16 per step
    ("train_ppo_ray", ["--micro_train_batch_size", "3"], "--micro_train_batch_size"),  # 8 % (3 x 2 ranks)
    ("train_ppo_ray", ["--colocate_all_models"], "--colocate_all_models"),  # 1 engine for 2 actor ranks
    ("train_ppo_ray", ["--ds_tensor_parallel_size", "4"], "--ds_tensor_parallel_size"),  # 2 actor ranks
    ("train_ppo_ray", ["--advantage_estimator", "ppo_magic"], "--advantage_estimator"),
    ("train_ppo_ray", ["--remote_rm_timeout", "0"], "--remote_rm_timeout"),
    ("train_ppo_ray", ["--remote_rm_retries", "-1"], "--remote_rm_retries"),
    ("train_ppo_ray", ["--reward_func_timeout", "0"], "--reward_func_timeout"),
    ("train_ppo_ray", ["--max_engine_restarts", "-1"], "--max_engine_restarts must be >= 0"),
    ("train_ppo_ray", ["--max_rank_restarts", "-2"], "--max_rank_restarts must be >= 0"),
    ("train_ppo_ray", ["--n_samples_per_prompt", "1", "--train_batch_size", "4"], "--n_samples_per_prompt"),
    ("train_ppo_ray", ["--generate_max_len", "-1"], "--generate_max_len"),
    ("train_ppo_ray", ["--prompt_max_len", "-5"], "--prompt_max_len"),
    ("train_ppo_ray", ["--lora_rank", "4", "--lora_alpha", "0"], "--lora_alpha"),
    ("train_ppo_ray", ["--vllm_kv_cache_bytes", "-1"], "--vllm_kv_cache_bytes"),
    # the default KV cache cannot hold one 100M-token sequence in this box's RAM
    ("train_ppo_ray", ["--generate_max_len", "100000000"], "--vllm_kv_cache_bytes"),
    ("train_ppo_ray", ["--min_lr_ratio", "2"], "--min_lr_ratio"),
    ("train_ppo_ray", ["--dist_timeout", "0"], "--dist_timeout"),
    ("plan", ["--pretrain", "/nonexistent/model"], "--pretrain"),
    ("plan", ["--device_memory_gib", "-1"], "--device_memory_gib"),
    ("serve_rm", ["--reward_func", "/nonexistent/reward.py"], "--reward_func"),
    ("serve_rm", ["--reward_func", "{no_func}"], "--reward_func"),
    ("serve_rm", ["--reward_func", "{no_func}", "--reward_func_timeout", "-1"], "--reward_func_timeout"),
    ("serve_rm", ["--reward_func_off", "--reward_pretrain", "/nonexistent/rm"], "--reward_pretrain"),
    ("serve_rm", ["--port", "70000"], "--port"),
    ("serve_rm", ["--host", "192.0.2.1"], "--host"),  # TEST-NET-1: never an address of this machine
    ("serve_rm", ["--normalize_reward"], "--normalize_reward"),
    ("make_task", ["--num_samples", "0"], "--num_samples"),
    ("make_task", ["--max_operand", "-1"], "--max_operand"),
    ("make_task", ["--out", "{file}/data.jsonl"], "--out"),
    ("make_task", ["--ops", "/"], "--ops"),
    ("make_task", ["--task", "shapes", "--max_shapes", "10"], "--max_shapes"),
    ("make_task", ["--task", "shapes", "--image_size", "5"], "--image_size"),
]


def _base(cli, files, save):
    if cli == "train_sft":
        return [
            "--pretrain",
            str(files["model"]),
            "--dataset",
            str(files["sft"]),
            "--apply_chat_template",
            "--train_batch_size",
            "4",
            "--micro_train_batch_size",
            "2",
            "--save_path",
            str(save),
        ]
    if cli in ("train_rm", "train_dpo"):
        return [
            "--pretrain",
            str(files["model"]),
            "--dataset",
            str(files["pairs"]),
            "--prompt_key",
            "prompt",
            "--apply_chat_template",
            "--train_batch_size",
            "4",
            "--micro_train_batch_size",
            "2",
            "--save_path",
            str(save),
        ]
    if cli in ("train_ppo_ray", "plan"):
        return [
            "--pretrain",
            str(files["model"]),
            "--remote_rm_url",
            str(files["reward"]),
            "--prompt_data",
            str(files["prompts"]),
            "--input_key",
            "input",
            "--label_key",
            "label",
            "--apply_chat_template",
            "--advantage_estimator",
            "group_norm",
            "--n_samples_per_prompt",
            "4",
            "--rollout_batch_size",
            "4",
            "--train_batch_size",
            "8",
            "--micro_train_batch_size",
            "2",
            "--actor_num_gpus_per_node",
            "2",
            "--vllm_num_engines",
            "1",
            "--init_kl_coef",
            "0",
            "--generate_max_len",
            "16",
            "--prompt_max_len",
            "64",
            "--save_path",
            str(save),
        ]
    if cli == "serve_rm":
        return ["--reward_func", str(files["reward"]), "--port", "0"]
    if cli == "make_task":
        return ["--out", str(save), "--num_samples", "4"]
    return ["--model_path", str(files["model"]), "--lora_path", str(files["adapter"]), "--output_path", str(save)]


def _merge(base: list[str], extra: list[str]) -> list[str]:
    """Later flags override earlier ones; a flag ending in _off removes that flag (and its value) from the base."""
    out = list(base)
    for flag in [e[: -len("_off")] for e in extra if e.startswith("--") and e.endswith("_off")]:
        if flag in out:
            at = out.index(flag)
            has_value = at + 1 < len(out) and not out[at + 1].startswith("--")
            del out[at : at + 1 + has_value]
    return out + [e for e in extra if not e.endswith("_off")]


@pytest.fixture
def no_launch(monkeypatch):
    """Whatever comes after validation (process group, Ray, the HTTP server) fails the test instead of running."""
    from openppo.ppo import launch
    from openppo.rewards import server
    from openppo.trainers import setup

    def launched(*args, **kwargs):
        raise AssertionError("the bad input got past validation")

    for module, name in ((launch, "start_ray"), (setup, "make_strategy"), (server, "serve")):
        monkeypatch.setattr(module, name, launched)


@pytest.mark.parametrize("cli,args,flag", CASES, ids=[f"{c}{a[0]}" for c, a, _ in CASES])
def test_bad_input_one_line_error(cli, args, flag, files, tmp_path, capsys, no_launch):
    save = tmp_path / "save"
    argv = _merge(_base(cli, files, save), [a.format(**{k: str(v) for k, v in files.items()}) for a in args])
    module = importlib.import_module(f"openppo.cli.{cli}")
    try:
        code = module.main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error:") and flag in lines[0], err
    assert not save.exists(), "nothing may be written on bad input"
