import os
import re

from v4kv_jax import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_runs_and_matches_the_oracle(capsys):
    rc = cli.main(["demo", "--lengths", "200", "40", "--decode-steps", "3", "--chunk", "32"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "Classical bytes/token" in out and "Dense per-token cache" in out
    assert re.search(r"Largest deviation from the brute-force oracle: \d\.\d\de-0[5-9]", out)
    assert re.search(r"req0 +203 +50 +1 ", out)


def test_memory_of_flash_preset(capsys):
    assert cli.main(["memory", "--preset", "flash", "--tokens", "1048576"]) == 0
    out = capsys.readouterr().out
    # 21 CSA layers x (512 + 128) x 2 B / 4 + 20 HCA layers x 512 x 2 B / 128
    assert "CSA 6720.0 B, HCA 160.0 B, total 6880.0 B" in out


def test_ci_runs_the_readme_test_command():
    readme = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    assert "v4kv demo" in blocks[0]
    assert "pytest" in blocks[1]
    assert blocks[1] in open(os.path.join(ROOT, ".ci", "run")).read()
