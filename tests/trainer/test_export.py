"""HF export folders: every export_every versions from the trainer, `streamrl export --version V`, and kept when
an ended run is archived."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from services.driver.driver import ENDED
from services.ops.cli.main import main
from services.ops.launch.runner import archive_ended_run
from services.trainer.trainer import Trainer
from shared.runtime import logs
from shared.runtime.config.keys import Config
from tests.trainer.test_trainer import _write_group


def test_periodic_export_cli_export_and_archiving(client, keys, tiny_model_dir, tmp_path, capsys):
    cfg = Config(
        run=keys.run,
        model_dir=tiny_model_dir,
        run_dir=str(tmp_path / "runs"),
        weights_dir=str(tmp_path / "weights"),
        batch_groups=1,
        lr=1e-2,
        export_every=2,
        max_staleness=100,
    )
    for g in ("a", "b", "c"):
        _write_group(client, keys, g)
    trainer = Trainer(cfg, client, logs.get("export-test"))
    trainer.run(should_stop=lambda: trainer.version >= 3)
    exports = cfg.run_path / "export"
    # every 2 versions
    assert sorted(p.name for p in exports.iterdir()) == ["v2"]
    v2 = AutoModelForCausalLM.from_pretrained(str(exports / "v2"))
    base = ["--run", cfg.run, "--run-dir", cfg.run_dir, "--weights-dir", cfg.weights_dir, "--model-dir", tiny_model_dir]
    capsys.readouterr()
    assert main(["export", "--version", "3", *base]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(exports / "v3")
    v3 = AutoModelForCausalLM.from_pretrained(str(exports / "v3"))
    assert any(not torch.equal(a, b) for a, b in zip(v2.state_dict().values(), v3.state_dict().values()))
    assert main(["export", "--version", "99", *base]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("streamrl export")]
    assert len(err) == 1 and "version 99" in err[0] and "kept: " in err[0]
    (cfg.run_path / ENDED).write_text("{}")
    dest = archive_ended_run(cfg)
    # archiving moves it, never deletes it
    assert (dest / "export" / "v3" / "model.safetensors").exists()
