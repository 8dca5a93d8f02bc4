"""README audit: `dflash2 bench sglang` keeps the README's promise for every bench (a bad option
value, or a bench that cannot run here, exits 2 with one error line; no traceback)."""

import importlib.util

import pytest

from dflash2 import cli

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None


@pytest.mark.parametrize("option", [["--pages", "0"], ["--repeat", "0"], ["--hbm-mb", "-1"], ["--hbm-mb", "1"]])
def test_bench_sglang_bad_option_is_a_usage_error(option, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "sglang", *option])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("dflash2 bench sglang: error:") and option[0] in err


@pytest.mark.skipif(HAVE_SGLANG, reason="sglang is installed: the bench runs")
def test_bench_sglang_without_sglang_says_so(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "sglang", "--json"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "needs 'sglang'" in err and ".[sglang]" in err


def test_bench_sglang_bad_dir_is_a_usage_error(tmp_path, capsys):
    if not HAVE_SGLANG:
        pytest.skip("without sglang the bench stops before it makes its scratch folder")
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "sglang", "--dir", str(tmp_path / "missing")])
    assert exc.value.code == 2
    assert "--dir" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["status", "history"])
@pytest.mark.parametrize("bad", ["bogus", "tcp://host", "tcp://host:0", "ipc://"])
def test_a_malformed_endpoint_is_a_usage_error(command, bad, capsys):
    """`dflash2 status --endpoint bogus` said no daemon answers (exit 1): the option is wrong (exit 2)."""
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--endpoint", bad])
    assert exc.value.code == 2
    assert "--endpoint" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["status", "history"])
def test_an_endpoint_longer_than_a_socket_path_may_be_is_a_usage_error(command, capsys):
    """`--endpoint ipc://PATH` past 107 bytes went on to "File name too long", exit 1, where dflash2d
    --check refuses it in a config, exit 2 (a review): refused so here, in the config's words."""
    path = "/tmp/" + "x" * 103  # (108 bytes)
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--endpoint", f"ipc://{path}"])
    assert exc.value.code == 2
    assert (f"argument --endpoint: the socket path {path!r} is longer than 107 bytes, the Unix limit"
            in capsys.readouterr().err)
    with pytest.raises(SystemExit):  # (107 bytes pass: no daemon there, exit 1)
        cli.main([command, "--endpoint", f"ipc://{path[:-1]}", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.parametrize("endpoint", ["tcp://:31701", "tcp://[]:31701"])
@pytest.mark.parametrize("command", ["status", "history"])
def test_an_endpoint_without_a_host_names_the_host(command, endpoint, capsys):
    """`--endpoint tcp://:31701` was refused for want of "a port in 1..65535" (a review); `tcp://[]:31701`,
    no host once the brackets are off, passed and was told of a missing key file, exit 1 (a review)."""
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--endpoint", endpoint, "--timeout", "0.5"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --endpoint: '{endpoint}' names no host" in err and "65535" not in err, err


def test_readmes_known_gaps_give_each_gap_of_docs_known_gaps_in_short():
    """README's Known gaps say "each in short" of docs/known-gaps.md: a new user's walk found two
    there (the bound on a tier's room walking above the blocks that stay, and an exception of the
    caller's after a reply arrived) that the list left out."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    listed = readme[readme.index("\n## Known gaps\n"):]

    def anchor(title: str) -> str:
        return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")

    gaps = [anchor(m.group(1)) for m in re.finditer(r"^## (.+)$", (root / "docs/known-gaps.md").read_text(), re.M)]
    linked = set(re.findall(r"known-gaps\.md#([\w-]+)", listed))
    # (One is told in the list without a link: its whole text is one line.)
    missing = [g for g in gaps if g not in linked and g != "the-two-gpu-churn-tests-last-version"]
    assert not missing, f"README's Known gaps leave out {missing}"
