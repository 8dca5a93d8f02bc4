"""What `bench control` and `bench drain` measure around their daemon: when the daemon's own figures
are read, and how long its start-up may take (reviews)."""

import json

from dflash2 import cli


def test_control_reads_the_daemons_lookup_mean_before_the_1000_key_lookups(capsys, monkeypatch):
    """daemon_handle_mean_us["lookup"] sits beside the one-key lookup's p50: it was read after the
    1000-key lookups, whose time the daemon's mean per op took in (50 us at --batch-iterations 1,
    217 at 1000, a review)."""
    from dflash2.client import Client

    calls = []
    lookup, stats = Client.lookup, Client.stats
    monkeypatch.setattr(Client, "lookup",
                        lambda self, keys, *a, **kw: calls.append(len(keys)) or lookup(self, keys, *a, **kw))
    monkeypatch.setattr(Client, "stats", lambda self, *a, **kw: calls.append("stats") or stats(self, *a, **kw))
    argv = ["bench", "control", "--iterations", "20", "--batch-iterations", "3", "--seconds", "0.2",
            "--processes", "1", "--json"]
    assert cli.main(argv) == 0
    assert "lookup" in json.loads(capsys.readouterr().out)["daemon_handle_mean_us"]
    assert calls.count("stats") == 1 and 1000 not in calls[:calls.index("stats")], calls


def test_drains_daemon_is_given_a_start_up_wait_for_its_tiers(tmp_path, monkeypatch):
    """`bench drain` started its daemon with the 30 s wait whatever its DRAM: --dram-mb 14336 was not
    ready within it on the 2-core VM (20 s at 8192), where `bench calls` waits longer for its tiers (a
    review)."""
    from dflash2.bench import drain

    asked = []
    monkeypatch.setattr(drain, "_start", lambda argv, ready, log, tiers_mb=0: asked.append(tiers_mb))
    drain._start_daemon(tmp_path, f"ipc://{tmp_path}/d.sock", 8192, 16384, drain.layout(64))
    assert asked and asked[0] >= 8192, asked
