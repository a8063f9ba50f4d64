import pytest

from shared.runtime.config.errors import ConfigError
from shared.runtime.config.keys import Config
from shared.runtime.config.sources import load


def test_precedence_file_env_flag(tmp_path, monkeypatch):
    # no runs/demo/secrets.json of a real run here: loading fills secrets from it
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "c.toml"
    path.write_text('run = "fromfile"\nflush_tokens = 8\nflush_ms = 10\n')
    cfg = load(str(path), env={"STREAMRL_FLUSH_TOKENS": "32"}, overrides={"flush_ms": "5.5"})
    assert (cfg.run, cfg.flush_tokens, cfg.flush_ms) == ("fromfile", 32, 5.5)
    assert load(env={}) == Config()


def test_redis_url_env_with_password():
    cfg = load(env={"REDIS_URL": "redis://:pw@127.0.0.1:7000/2"})
    assert cfg.redis_url == "redis://:pw@127.0.0.1:7000/2"


@pytest.mark.parametrize(
    "source, words",
    [
        ({"file": "flush_tokenz = 3\n"}, "unknown config key 'flush_tokenz' (from file"),
        ({"file": 'flush_tokens = "many"\n'}, "'flush_tokens' (from file"),
        ({"env": {"STREAMRL_FLUSH_MS": "soon"}}, "'flush_ms' (from environment STREAMRL_FLUSH_MS): expected float"),
        ({"env": {"STREAMRL_NOPE": "1"}}, "unknown config key 'nope'"),
        ({"flags": {"flush_tokens": "1.5"}}, "'flush_tokens' (from flag --flush-tokens): expected int"),
        ({"flags": {"flush_tokens": "0"}}, "'flush_tokens': expected an integer >= 1, got 0"),
        ({"flags": {"rollout_workers": "0"}}, "'rollout_workers': expected an integer >= 1, got 0"),
        ({"flags": {"fail_fast_groups": "-1"}}, "config key 'fail_fast_groups': expected an integer >= 0"),
        ({"flags": {"longtail_workers": "2"}}, "'longtail_workers': expected 0 to rollout_workers (1), got 2"),
        ({"flags": {"run": "a b"}}, "config key 'run'"),
        ({"file": "not toml ===\n"}, "not valid TOML"),
    ],
)
def test_bad_values_name_the_key_and_source(tmp_path, source, words):
    path = None
    if "file" in source:
        path = tmp_path / "c.toml"
        path.write_text(source["file"])
    with pytest.raises(ConfigError) as err:
        load(str(path) if path else None, env=source.get("env", {}), overrides=source.get("flags"))
    assert words in str(err.value)


def test_missing_file_is_clear():
    with pytest.raises(ConfigError, match="config file /nonexistent.toml"):
        load("/nonexistent.toml", env={})


def test_simulated_costs_must_not_be_negative():
    for key in ("step_delay_ms", "simulated_train_us_per_token", "simulated_load_ms"):
        with pytest.raises(ConfigError, match=f"{key}.*expected >= 0"):
            load(env={}, overrides={key: "-1"})
