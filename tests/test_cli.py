import argparse
import os
import re
import subprocess
import sys

import jax
import pytest

from v4kv_jax import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = ["demo", "--lengths", "200", "40", "--decode-steps", "3", "--chunk", "32"]
PHASES = ("prefill program", "decode step program", "Engine's programs")


def run_demo(cache_dir, *, log_compiles: bool = False) -> subprocess.CompletedProcess:
    """`v4kv demo` in a new process with jax's persistent compilation cache in `cache_dir`
    (tests/conftest.py turns the cache off for the suite's processes: this one turns it on)."""
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="true",
               JAX_COMPILATION_CACHE_DIR=str(cache_dir))
    env.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)  # the CLI's own: keep all
    if log_compiles:  # jax then logs each load from the cache as a warning
        env["JAX_LOG_COMPILES"] = "true"
    proc = subprocess.run([sys.executable, "-m", "v4kv_jax.cli", *DEMO], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def cache_entries(cache_dir) -> set[str]:
    return {name for name in os.listdir(cache_dir) if name.endswith("-cache")}


def results(out: str) -> list[str]:
    """The demo's lines that hold no seconds or rates: the same for every run."""
    return [line for line in out.splitlines()
            if re.search(r"req\d: \.\.\.|deviation|equals|cached tokens|pages shared", line)]


def test_demo_runs_and_matches_the_oracle_and_a_second_run_loads_its_programs(tmp_path):
    cache_dir = tmp_path / "jax-cache"
    out = run_demo(cache_dir).stdout
    assert "Classical bytes/token" in out and "Dense per-token cache" in out
    assert re.search(r"Largest deviation from the brute-force oracle: \d\.\d\de-0[5-9]", out)
    assert re.search(r"req0 +203 +50 +1 ", out)
    # The prefix step: req0's first page is shared, and the hit's output is the cold run's.
    assert "cached tokens 128 of 153 (State restored by snapshot on the device tier" in out
    assert "Prefix hit equals the cold run: yes" in out
    # Before each compilation, which shows nothing for seconds: what, how long, and that the
    # next run loads it from the cache; after it, the seconds.
    assert f"Compilation cache: {cache_dir} (JAX_COMPILATION_CACHE_DIR moves it" in out
    lines = out.splitlines()
    for phase in PHASES:
        notice = next(i for i, line in enumerate(lines)
                      if line.strip().startswith(f"compiling the {phase}"))
        assert re.search(r"\(about \d+ s on a 2-core CPU; the next run loads it from the "
                         r"compilation cache\) \.\.\.$", lines[notice]), lines[notice]
        ready = lines[notice + 1]
        assert ready.strip().startswith(f"{phase} ready") and re.search(
            r": \d+\.\d s \(\d+ programs? compiled and written to the compilation cache\)$",
            ready), ready
    written = cache_entries(cache_dir)
    assert len(written) >= 3

    # A second process: every program comes from the cache, none is compiled (the cache
    # keeps every program: nothing new is written), and the results are the same.
    second = run_demo(cache_dir, log_compiles=True)
    out2 = second.stdout
    assert "this one finds programs there." in out2 and "compiling the" not in out2
    for phase in PHASES:
        assert f"loading the {phase} from the compilation cache" in out2, phase
    assert len(re.findall(r" ready.*: \d+\.\d s \(\d+ programs? loaded from the compilation "
                          r"cache\)$", out2, re.M)) == 3, out2
    assert "compiled and written" not in out2
    assert cache_entries(cache_dir) == written
    hits = set(re.findall(r"Persistent compilation cache hit for '[^']+' with key '([^']+)'",
                          second.stderr))
    assert {f"{key}-cache" for key in hits} == written
    assert results(out2) == results(out) and len(results(out)) >= 6


def test_the_compilation_cache_is_per_user_and_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cli.default_cache_dir() == str(tmp_path / "xdg" / "v4kv_jax" / "jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cli.default_cache_dir() == str(tmp_path / "home" / ".cache" / "v4kv_jax" / "jax")
    assert cli._parser().parse_args(["demo", "--no-compile-cache"]).no_compile_cache
    assert not cli._parser().parse_args(["demo"]).no_compile_cache
    config = ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
              "jax_persistent_cache_min_compile_time_secs")
    before = {name: getattr(jax.config, name) for name in config}
    try:
        monkeypatch.setenv("JAX_ENABLE_COMPILATION_CACHE", "true")
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "mine"))
        assert cli.compile_cache() == str(tmp_path / "mine")
        assert jax.config.jax_enable_compilation_cache
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
        assert cli.compile_cache() == str(tmp_path / "home" / ".cache" / "v4kv_jax" / "jax")
        assert cli.compile_cache(enabled=False) is None  # --no-compile-cache
        assert not jax.config.jax_enable_compilation_cache
        for off in ("false", "0", "False"):
            monkeypatch.setenv("JAX_ENABLE_COMPILATION_CACHE", off)
            assert cli.compile_cache() is None
    finally:
        for name, value in before.items():
            jax.config.update(name, value)


def test_memory_of_flash_preset(capsys):
    assert cli.main(["memory", "--preset", "flash", "--tokens", "1048576"]) == 0
    out = capsys.readouterr().out
    # Release formats by default: 21 CSA layers x (584 + 68) B / 4 + 20 HCA layers x 584 B / 128
    assert "formats release" in out
    assert "CSA 3423.00 B, HCA 91.25 B, total 3514.25 B" in out
    # As stored, rows in 128-lane planes (docs/formats.md): a CSA entry of 146 words is 128 +
    # 16 + 4 (its last 2 words share a lane row with 63 others of the page's 32 entries); its
    # keys of 17 words 16 + 4: 21 x (148 + 20) x 4 B / 4. An HCA page's one entry fills two
    # lane rows: 20 x 256 x 4 B / 128.
    assert "as stored (lane-dense pools): CSA 3528.00 B, HCA 160.00 B, total 3688.00 B" in out
    assert "(x1.049 of the entries' own bytes)" in out and "(5,057,544 B) per request" in out
    assert cli.main(["memory", "--preset", "flash", "--tokens", "1048576",
                     "--formats", "bfloat16"]) == 0
    # 21 CSA layers x (512 + 128) x 2 B / 4 + 20 HCA layers x 512 x 2 B / 128
    out = capsys.readouterr().out
    assert "CSA 6720.00 B, HCA 160.00 B, total 6880.00 B; as stored" in out
    assert "total 6880.00 B (x1.000)" in out  # rows of 256 and 64 words fill their lanes


def test_memory_with_hisparse(capsys):
    assert cli.main(["memory", "--preset", "flash", "--tokens", "1048576",
                     "--hot-rows", "1024"]) == 0
    out = capsys.readouterr().out
    # The C4 entries (21 x 148 words x 4 B / 4 = 3108 B/token as stored) leave the device;
    # 21 hot sets of 1024 rows of 584 + 8 B join the State: 5,057,544 + 21 x 1024 x 592 =
    # 17,787,912 B.
    assert "(17,787,912 B) per request" in out
    assert ("device Classical 580.00 MiB, host 3,108.00 MiB per request of 1,048,576 tokens; "
            "device 596.96 MiB with the State and hot sets 16.96 MiB") in out
    # 64 GiB / 596.96 MiB: 109 requests per device, each with 3,108 MiB of C4 entries on the
    # host: 109 x 3,108 MiB = 330.83 GiB of host memory per device.
    assert "data parallel over 1 device 109 per device" in out
    assert ("Host memory they need (HiSparse): 109 x 3,108.00 MiB of C4 entries = 330.83 GiB "
            "per device, 330.83 GiB over the 1 device (data parallel)") in out
    assert cli.main(["memory", "--preset", "flash", "--tokens", "1048576", "--hot-rows", "1024",
                     "--devices", "2"]) == 0
    assert "= 330.83 GiB per device, 661.66 GiB over the 2 devices" in capsys.readouterr().out
    assert cli.main(["memory", "--preset", "flash", "--tokens", "1048576"]) == 0
    assert "Host memory" not in capsys.readouterr().out


def test_memory_over_devices(capsys):
    assert cli.main(["memory", "--preset", "flash", "--tokens", "1048576", "--devices", "8",
                     "--device-gib", "64"]) == 0
    out = capsys.readouterr().out
    # 3,688 MiB of pages as stored + 5,057,544 B of State = 3,692.82 MiB a request: 17 in
    # 64 GiB.
    assert ("data parallel over 8 devices 17 per device, 136 in total; tensor parallel over "
            "8 devices 17 in total") in out
    assert cli.main(["memory", "--preset", "flash", "--tokens", "1048576", "--devices", "2",
                     "--device-gib", "3"]) == 0
    assert "0 per device, 0 in total" in capsys.readouterr().out


def test_memory_at_one_token(capsys):
    assert cli.main(["memory", "--tokens", "1"]) == 0
    out = capsys.readouterr().out
    # One page of 128 tokens is held, but 1 token completes no C4 entry (4 tokens) and no
    # C128 entry: all of the page is padding; the State does not depend on the context.
    # A page as stored: 128 x 3688 B = 0.45 MiB; with the State 5,529,608 B a request.
    assert ("At 1 token: Classical 0.45 MiB as stored in 1 page (no compressed entry is "
            "complete before 4 tokens), State 4.82 MiB (5,057,544 B) per request") in out
    assert "Requests of 1 token in 64 GiB" in out and "over 1 device 12,427 per device" in out
    assert " 1 tokens" not in out and "1 pages" not in out and "device(s)" not in out
    assert cli.main(["memory", "--tokens", "4"]) == 0
    # One C4 entry per CSA layer (21 x (584 + 68) B = 13,692 B) in a page of 472,064 B.
    assert "in 1 page (x34.477 of the entries' own bytes)" in capsys.readouterr().out


def test_memory_says_when_no_request_fits(capsys):
    assert cli.main(["memory", "--tokens", "1", "--device-gib", "0.001"]) == 0
    out = capsys.readouterr().out
    assert "0 per device, 0 in total" in out
    assert ("Not one request fits: each needs 5.27 MiB on the device, more than --device-gib "
            "0.001") in out


def _help(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal width


def test_help_describes_every_command(capsys):
    out = _help(capsys, ["--help"])
    assert "v4kv demo prefill + decode a ragged batch" in out  # the module docstring
    assert "demo prefill + decode a ragged batch on a small random model and check it" in out
    assert "memory cache cost of a preset (flash, pro, flash41) at a context length" in out
    assert "check every Pallas kernel against the jnp reference on this machine's" in out
    assert "`v4kv <command> --help` lists the options of a command" in out


@pytest.mark.parametrize("command", ["demo", "memory", "check"])
def test_help_of_a_command_gives_every_option_its_default(capsys, command):
    out = _help(capsys, [command, "--help"])
    sub = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    for action in sub.choices[command]._actions:
        if action.dest == "help":
            continue
        text = " ".join(action.help.split())
        assert f"{action.option_strings[0]} " in out and text in out, action.dest
        after = out[out.index(text) + len(text):]
        assert "(default: " in text or after.startswith(" (default: "), action.dest
    if command == "demo":
        assert "(default: 700 384 129 37)" in out and "(default: 24)" in out
        assert "(default: 128)" in out and "(default: 64)" in out and "(default: 0)" in out
        assert "(default: 32)" in out and "(default: 512)" in out
        assert "(default: scanned)" in out and "(default: False)" not in out
    elif command == "check":
        assert "(default: flash)" in out and "(default: 4096)" in out
        assert "(default: the preset's widths)" in out and "(default: all)" in out
        assert "(default: None)" not in out and "(default: False)" not in out
    else:
        assert "(default: flash)" in out and "(default: 1048576)" in out
        assert ("(default: the preset's: release for flash, pro and flash41, float32 for tiny)"
                in out)
        assert "(default: 0)" in out and "(default: 1)" in out and "(default: 64.0)" in out
        assert "(default: None)" not in out


def test_ci_runs_the_readme_test_command():
    readme = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    assert "v4kv demo" in blocks[0]
    assert "pytest" in blocks[1]
    assert blocks[1] in open(os.path.join(ROOT, ".ci", "run")).read()


@pytest.mark.parametrize("argv, message", [
    (["demo", "--chunk", "0"], "argument --chunk: expected an integer >= 1; got '0'"),
    (["demo", "--chunk", "-8"], "argument --chunk: expected an integer >= 1; got '-8'"),
    (["demo", "--lengths", "64", "0"], "argument --lengths: expected an integer >= 1; got '0'"),
    (["demo", "--lengths", "-5"], "argument --lengths: expected an integer >= 1; got '-5'"),
    (["demo", "--pages", "0"], "argument --pages: expected an integer >= 1; got '0'"),
    (["demo", "--decode-steps", "-1"],
     "argument --decode-steps: expected an integer >= 0; got '-1'"),
    (["demo", "--new-tokens", "0"], "argument --new-tokens: expected an integer >= 1; got '0'"),
    (["demo", "--vocab", "0"], "argument --vocab: expected an integer >= 1; got '0'"),
    (["demo", "--seed", "1.5"],
     "argument --seed: expected an integer in [0, 4294967295]; got '1.5'"),
    (["demo", "--seed", "-1"], "argument --seed: expected an integer in [0, 4294967295]; "
                               "got '-1'"),
    (["demo", "--seed", "abc"], "argument --seed: expected an integer in [0, 4294967295]; "
                                "got 'abc'"),
    (["demo", "--lengths", "200", "40", "--decode-steps", "3", "--pages", "2"],
     "argument --pages: expected at least 3 (pages of 128 tokens that prompts of [200, 40] "
     "tokens need with --decode-steps 3 and --new-tokens 32); got 2"),
    (["demo", "--lengths", "120", "--decode-steps", "9", "--new-tokens", "8", "--pages", "1"],
     "argument --pages: expected at least 2 "),
    (["memory", "--tokens", "-5"], "argument --tokens: expected an integer >= 1; got '-5'"),
    (["memory", "--tokens", "0"], "argument --tokens: expected an integer >= 1; got '0'"),
    (["memory", "--tokens", "1e6"], "argument --tokens: expected an integer >= 1; got '1e6'"),
    (["memory", "--tokens", "1.5"], "argument --tokens: expected an integer >= 1; got '1.5'"),
    (["memory", "--tokens", ""], "argument --tokens: expected an integer >= 1; got ''"),
    (["memory", "--hot-rows", "100"], "argument --hot-rows: expected 0 or at least the flash "
                                      "preset's index_topk=512; got 100"),
    (["memory", "--hot-rows", "-1"], "argument --hot-rows: expected an integer >= 0; got '-1'"),
    (["memory", "--devices", "0"], "argument --devices: expected an integer >= 1; got '0'"),
    (["memory", "--device-gib", "0"], "argument --device-gib: expected a number of GiB > 0; "
                                      "got '0'"),
])
def test_nonsensical_options_are_rejected_by_name(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"v4kv {argv[0]}: error: {message}" in err, err


def test_subcommands_called_directly_check_their_namespace():
    good = dict(lengths=[64, 8], decode_steps=2, chunk=16, pages=4, seed=0, new_tokens=4,
                vocab=32, unroll=False)
    with pytest.raises(ValueError, match=r"--chunk: expected an integer in \[1, inf\]; got 0"):
        cli.demo(argparse.Namespace(**dict(good, chunk=0)))
    with pytest.raises(ValueError, match=r"--lengths: expected an integer in \[1, inf\]; got 0"):
        cli.demo(argparse.Namespace(**dict(good, lengths=[64, 0])))
    with pytest.raises(TypeError, match="--seed: expected an integer; got 0.5"):
        cli.demo(argparse.Namespace(**dict(good, seed=0.5)))
    with pytest.raises(ValueError, match=r"--pages: expected at least 2 .*; got 1"):
        cli.demo(argparse.Namespace(**dict(good, pages=1)))
    with pytest.raises(TypeError, match="--vocab: expected a value"):
        cli.demo(argparse.Namespace(**{k: v for k, v in good.items() if k != "vocab"}))
    with pytest.raises(ValueError, match=r"--tokens: expected an integer in \[1, inf\]; got -5"):
        cli.memory(argparse.Namespace(preset="flash", tokens=-5, formats="bfloat16"))
    with pytest.raises(ValueError, match=r"--tokens: expected an integer in \[1, inf\]; got 0"):
        cli.memory(argparse.Namespace(preset="flash", tokens=0))
    with pytest.raises(TypeError, match=r"--tokens: expected an integer; got True"):
        cli.memory(argparse.Namespace(preset="flash", tokens=True))
    with pytest.raises(ValueError, match=r"--formats: expected one of \('release', 'float32', "
                                         r"'bfloat16', 'float16'\); got 'fp8'"):
        cli.memory(argparse.Namespace(preset="flash", tokens=5, formats="fp8"))
    with pytest.raises(ValueError, match=r"--preset: expected one of \('flash', 'flash41', 'pro', "
                                         r"'tiny'\); got 'huge'"):
        cli.memory(argparse.Namespace(preset="huge", tokens=5, formats="bfloat16"))
    with pytest.raises(ValueError, match=r"--device-gib: expected a number in \(0.0, inf\]; "
                                         "got -2.0"):
        cli.memory(argparse.Namespace(preset="flash", tokens=5, device_gib=-2.0))


def test_the_test_command_ends_with_the_pytest_summary():
    """README runs `pytest -q`; a second -q from the config would silence the summary line."""
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        options = tomllib.load(f)["tool"]["pytest"]["ini_options"]
    assert "-q" not in str(options.get("addopts", "")).split()
