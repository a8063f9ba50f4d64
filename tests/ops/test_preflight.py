"""`streamrl run`'s preflight: each bad input is one exact line and exit 2 before any process starts, with nothing
written under run_dir (the table below is the issue's bad-input table)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from services.ops.cli.main import main
from services.ops.launch.preflight import lora_problems, split_problems
from shared.protocol.keys import Keys

ROOT = Path(__file__).resolve().parents[2]
ROW = {"prompt": "1+1=", "answer": "2"}
CHAT = {"messages": [{"role": "user", "content": "1+1="}], "answer": "2"}
FILES = {
    "ok.jsonl": json.dumps(ROW) + "\n",
    "bad.jsonl": json.dumps(ROW) + "\n" + '{"prompt": oops\n',
    "noanswer.jsonl": json.dumps({"prompt": "1+1="}) + "\n",
    "chat.jsonl": json.dumps(CHAT) + "\n",
    "long.jsonl": json.dumps({"prompt": "1" * 600, "answer": "2"}) + "\n",
}

# (flags, the exact lines on stderr); {model} is the tiny model's folder, {plain} the same model without a chat template
CASES = [
    (["--dataset", "missing.jsonl"], ["config key 'dataset': missing.jsonl: no such file"]),
    (["--dataset", "bad.jsonl"], ["config key 'dataset': bad.jsonl: line 2: not JSON (Expecting value)"]),
    (
        ["--dataset", "noanswer.jsonl"],
        [
            "config key 'dataset': noanswer.jsonl: row 0: missing field 'answer' (config key 'answer_key'; "
            "columns: prompt)"
        ],
    ),
    (
        ["--dataset", "ok.jsonl", "--eval-dataset", "noanswer.jsonl"],
        [
            "config key 'eval_dataset': noanswer.jsonl: row 0: missing field 'answer' (config key 'answer_key'; "
            "columns: "
            "prompt)"
        ],
    ),
    (
        ["--dataset", "chat.jsonl", "--prompt-key", "question"],
        [
            "config key 'dataset': chat.jsonl: row 0: missing field 'question' (config key 'prompt_key'; columns: "
            "messages, answer)"
        ],
    ),
    (
        ["--dataset", "ok.jsonl", "--dataset-split", "validation"],
        [
            "config key 'dataset_split': 'validation', but 'ok.jsonl' is a local file with no splits (all its "
            "rows are one "
            "set); leave dataset_split at 'train', and give the held-out rows as eval_dataset"
        ],
    ),
    (
        ["--dataset", "ok.jsonl", "--eval-dataset", "ok.jsonl", "--eval-split", "validation"],
        [
            "config key 'eval_split': 'validation', but 'ok.jsonl' is a local file with no splits (all its rows "
            "are one "
            "set); leave eval_split at 'test'"
        ],
    ),
    (
        ["--dataset", "chat.jsonl", "--model-dir", "{plain}"],
        [
            "config key 'dataset': chat.jsonl: row 0: a chat-message prompt needs a tokenizer with a chat "
            "template; this "
            "one has none (give the model folder a chat_template, or use text prompts) (tokenizer '{plain}')"
        ],
    ),
    (
        ["--dataset", "long.jsonl"],
        [
            "config key 'dataset': long.jsonl: row 0: the prompt is 600 tokens; the context of '{model}' is 512 tokens "
            "(prompt + completion)"
        ],
    ),
    (
        ["--lora-rank", "4", "--lora-targets", "q_proj,nope_proj"],
        [
            "config key 'lora_targets': 'nope_proj' names no module of '{model}' (its modules: act_fn, down_proj, "
            "embed_tokens, gate_proj, input_layernorm, k_proj, layers, lm_head, mlp, model, norm, o_proj, "
            "post_attention_layernorm, q_proj, rotary_emb, self_attn, up_proj, v_proj)"
        ],
    ),
    (["--reward-fn", "nope:f"], ["config key 'reward_fn': 'nope:f': cannot load (No module named 'nope')"]),
    (
        ["--tools", "examples.calc:nope"],
        ["config key 'tools': 'examples.calc:nope': cannot load (module 'examples.calc' has no attribute 'nope')"],
    ),
    (["--tools", "nope"], ["config key 'tools': 'nope': not a built-in tool (calc) nor a 'module:function' spec"]),
    (["--agent", "nope:agent"], ["config key 'agent': 'nope:agent': cannot load (No module named 'nope')"]),
    (
        ["--model-dir", "models/nope"],
        [
            "config key 'model_dir': 'models/nope' does not resolve: no folder '{cwd}/models/nope', and hub id "
            "'models/nope' is not "
            "in the local Hugging Face cache (HF_HUB_OFFLINE is set)"
        ],
    ),
    (["--procfile", "Nofile"], ["--procfile Nofile: no such file in {cwd} nor in streamrl's checkout " + str(ROOT)]),
    # several problems: one line each, all of them
    (
        ["--dataset", "bad.jsonl", "--reward-fn", "nope:f"],
        [
            "config key 'dataset': bad.jsonl: line 2: not JSON (Expecting value)",
            "config key 'reward_fn': 'nope:f': cannot load (No module named 'nope')",
        ],
    ),
]


@pytest.fixture(scope="module")
def plain_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model with its chat template taken out."""
    out = tmp_path_factory.mktemp("plain") / "model"
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return str(out)


@pytest.mark.parametrize("flags,lines", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_is_one_line_each_exit_2_and_nothing_under_runs(
    flags, lines, tiny_model_dir, plain_model_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # `examples` importable, as in the checkout (the checks run in a child)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.delenv("REDIS_URL", raising=False)
    for name, text in FILES.items():
        Path(name).write_text(text)
    fill = {"model": tiny_model_dir, "plain": plain_model_dir, "cwd": str(tmp_path)}
    flags = [f.format(**fill) for f in flags]
    procfile = [] if "--procfile" in flags else ["--procfile", str(ROOT / "Procfile")]
    rc = main(["run", "--model-dir", tiny_model_dir, *flags, *procfile, "--run-dir", "runs"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err == [f"streamrl run: {line.format(**fill)}" for line in lines]
    assert not Path("runs").exists()


def test_a_good_input_passes(tiny_model_dir, tmp_path):
    from services.ops.launch import preflight
    from shared.runtime.config.keys import Config

    (tmp_path / "chat.jsonl").write_text(json.dumps(CHAT) + "\n")
    assert preflight.problems(Config(model_dir=tiny_model_dir)) == []
    assert (
        preflight.problems(
            Config(
                model_dir=tiny_model_dir,
                dataset=str(tmp_path / "chat.jsonl"),
                lora_rank=2,
                lora_targets="q_proj,v_proj",
            )
        )
        == []
    )


def test_lora_targets_match_module_name_endings():
    names = ["model", "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"]
    assert lora_problems("all-linear", names, "m") == [] and lora_problems("q_proj, up_proj", names, "m") == []
    assert lora_problems("self_attn.q_proj", names, "m") == []
    assert "'k_proj'" in lora_problems("q_proj,k_proj", names, "m")[0]


def test_splits_of_a_local_file_or_builtin_task_are_refused_unless_the_default():
    assert split_problems("data.jsonl", "train", "dataset_split", "train") == []
    # a hub set has splits
    assert split_problems("someone/hub-set", "validation", "dataset_split", "train") == []
    # no eval_dataset: no split to name
    assert split_problems("", "validation", "eval_split", "test") == []
    assert "built-in task" in split_problems("arithmetic", "x", "dataset_split", "train")[0]


def test_specs_import_from_the_working_directory_as_the_services_do():
    """`streamrl` is a console script: its sys.path starts with the venv's bin, not the working directory, while
    every service (`python -m ...`) imports from the working directory. The README's `--agent examples.calc:agent`
    must pass the preflight (it failed: "No module named 'examples'")."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = (
        "from services.ops.launch.preflight import _specs; from shared.runtime.config.keys import Config; "
        "print(_specs(Config(agent='examples.calc:agent')))"
    )
    out = subprocess.run([sys.executable, "-I", "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_continued_run_whose_model_changed_from_dense_to_moe_is_refused(
    client, redis_url, keys, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """The run records its model's routing shape when it is created (Redis meta and run.json); continued on a model
    that routes otherwise (here the same folder, now a mixture of experts) it is refused at preflight, one line."""
    from services.ops.launch import preflight
    from services.ops.launch.tiny_model import make_tiny_model
    from shared.runtime import runstate
    from shared.runtime.config.keys import Config

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    cfg = Config(run=keys.run, run_dir=str(tmp_path / "runs"), model_dir=str(model))
    meta = runstate.bind(client, keys, cfg.run_path, redis_url, config=runstate.recordable(cfg))
    dense = {"moe": False}
    assert runstate.recorded_shape(meta) == dense == runstate.recorded_shape(runstate.read_marker(cfg.run_path))
    assert preflight.problems(cfg) == []
    shutil.rmtree(model)
    make_tiny_model(model, moe="qwen3")
    line = (
        f"config key 'model_dir': run {keys.run!r} was interrupted; it was made on a dense model "
        f"({cfg.run_path / 'run.json'}), and {str(model)!r} is a mixture of experts (2 MoE layers, top-2 of 8 "
        f"experts): continue it with the model it was made with, or start another with --run NAME"
    )
    assert preflight.problems(cfg) == [line]
    # `streamrl run` says it and starts nothing
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REDIS_URL", raising=False)
    # the checks run in a child: this checkout's
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    before = sorted(p.name for p in cfg.run_path.iterdir())
    capsys.readouterr()
    rc = main(
        [
            "run",
            "--run",
            keys.run,
            "--run-dir",
            cfg.run_dir,
            "--model-dir",
            str(model),
            "--procfile",
            str(ROOT / "Procfile"),
        ]
    )
    assert rc == 2 and capsys.readouterr().err.strip().splitlines() == [f"streamrl run: {line}"]
    assert sorted(p.name for p in cfg.run_path.iterdir()) == before
    # a run made on the mixture of experts, continued on it with another top-k: refused the same way
    moe_keys = Keys(f"{keys.run}-moe")
    moe = cfg.replace(run=moe_keys.run)
    runstate.bind(client, moe_keys, moe.run_path, redis_url, config=runstate.recordable(moe))
    assert preflight.problems(moe) == []
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 4}))
    assert preflight.problems(moe) == [
        f"config key 'model_dir': run {moe_keys.run!r} was interrupted; it was made on a mixture of experts (2 MoE "
        f"layers, top-2 of 8 experts) ({moe.run_path / 'run.json'}), and {str(model)!r} is a mixture of experts "
        f"(2 MoE layers, top-4 of 8 experts): continue it with the model it was made with, or start another with "
        f"--run NAME"
    ]
