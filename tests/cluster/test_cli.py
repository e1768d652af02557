"""The command line: help that explains, errors that say what to do."""

import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from conftest import REPO, run_cli
from stripefs import cli
from stripefs.local_cluster import _is_mounted


@pytest.mark.parametrize(
    "args,words",
    [
        ([], ["local up"]),
        (["meta"], ["metadata", "--config"]),
        (["storage"], ["storage", "--config"]),
        (["mount"], ["META_ADDR", "MOUNTPOINT", "allow_other"]),
        (["local", "up"], ["--nodes", "--mount"]),
        (["layout", "set"], ["--chunk-size", "--replicas"]),
        (["status"], ["--json"]),
        (["meta"], ["meta backup FILE", "meta restore FILE"]),
        (["scrub"], ["PATH", "verify its files now"]),
    ],
)
def test_help_explains(args, words):
    out = " ".join(run_cli(*args, "--help").stdout.split())  # argparse wraps lines
    for w in words:
        assert w in out, (args, w)


def test_mount_without_a_daemon_says_so(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    res = run_cli("mount", f"tcp://127.0.0.1:{port}", str(tmp_path), "--log", str(tmp_path.parent / "m.log"), check=False)
    assert res.returncode != 0
    assert "no metadata daemon answered" in res.stderr and "Traceback" not in res.stderr
    assert not _is_mounted(tmp_path)
    # the error points to the log, and the log says why (it was empty)
    assert f"log: {tmp_path.parent / 'm.log'}" in res.stderr
    assert "no metadata daemon answered" in (tmp_path.parent / "m.log").read_text()
    res = run_cli("mount", "nonsense", str(tmp_path), check=False)
    assert res.returncode == 1 and "tcp://HOST:PORT" in res.stderr


def test_admin_command_without_a_cluster_says_how_to_find_one(tmp_path):
    res = run_cli("status", "--dir", str(tmp_path), check=False, env={"PATH": "/usr/bin:/bin"})
    assert res.returncode == 1 and "--meta" in res.stderr and "Traceback" not in res.stderr


def _clean_env() -> dict:
    """No $STRIPEFS_META or $STRIPEFS_KEY from the caller's shell: the command finds nothing by itself."""
    return {k: v for k, v in os.environ.items() if k not in ("STRIPEFS_META", "STRIPEFS_KEY")}


def test_every_subcommand_with_bad_arguments_says_one_line(tmp_path, monkeypatch, capsys):
    """Usage and user errors of every subcommand: one line on stderr, exit status non-zero, no traceback."""
    missing = str(tmp_path / "missing")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "old").write_text("x")
    empty = tmp_path / "empty"
    empty.mkdir()
    dead = "tcp://127.0.0.1:1"
    cases = [
        ["--bogus"], ["no-such-command"],
        ["meta"], ["meta", "--bogus"], ["meta", "--config", missing],
        ["meta", "backup"], ["meta", "backup", str(tmp_path / "b.db")], ["meta", "restore", missing, "--dir", missing],
        ["meta", "backup", "x", "--config", "a", "--dir", "b"],
        ["storage"], ["storage", "--config", missing],
        ["mount"], ["mount", dead], ["mount", "nonsense", str(empty)], ["mount", dead, str(a_file)],
        ["mount", dead, missing], ["mount", dead, str(full)], ["mount", dead, str(empty), "-o", "cache_dir=/x"],
        ["mount", dead, str(empty), "-o", "op_timeout=soon"], ["mount", dead, str(empty), "-o", "fuse_session=pyfuse3"],
        ["local"], ["local", "bogus"], ["local", "up", "--nodes", "x"], ["local", "up", "--meta-store", "x"],
        ["local", "status", "--dir", missing], ["local", "add-node", "--dir", missing], ["local", "down", "--bogus"],
        ["status", "--bogus"], ["status", str(tmp_path)],
        ["layout"], ["layout", "get"], ["layout", "get", str(tmp_path)],
        ["layout", "set", str(tmp_path), "--chunk-size", "abc"], ["layout", "set", str(tmp_path), "--chunk-size=-1M"],
        ["layout", "set", str(tmp_path), "--replicas", "x"], ["layout", "set", str(tmp_path), "--stripe-count", "1.5"],
        ["layout", "convert", str(tmp_path)], ["layout", "convert", str(tmp_path), "--ec", "4+2"],
        ["layout", "convert", str(tmp_path), "--ec", "x"],
        ["top", "--interval", "x"], ["top", str(tmp_path), "--once"], ["top", "-n", "0"], ["top", "-n", "-1"],
        ["install-mount-helper", "--dir", str(a_file / "sub")],
        ["warmup"], ["warmup", "--threads", "x"], ["warmup", missing], ["warmup", str(tmp_path), "--threads", "0"],
        ["node"], ["node", "drain", "x"], ["node", "undrain"], ["node", "remove", "3", "--dir", missing],
        ["scrub", "--bogus"], ["scrub", str(tmp_path)],
        ["fsck", "--bogus"], ["fsck", "--dir", missing],
        ["quota"], ["quota", "set", str(tmp_path), "--bytes", "abc"], ["quota", "set", str(tmp_path)],
        ["quota", "set", str(tmp_path), "--inodes", "-3"], ["quota", "get"], ["quota", "list", str(tmp_path)],
        ["quota", "recount", "--bogus"],
        ["keygen"], ["keygen", str(a_file / "k")],
        ["cap-secret"], ["cap-secret", str(a_file / "s")], ["cap-secret", str(tmp_path / "s"), "--rotate", "--force"],
        ["config"], ["config", "example"], ["config", "example", "bogus"],
    ]

    monkeypatch.chdir(tmp_path)  # no ./.stripefs here
    for name in ("STRIPEFS_META", "STRIPEFS_KEY"):
        monkeypatch.delenv(name, raising=False)
    wrong = []
    for args in cases:  # in this process: python -m stripefs is sys.exit(main()), and 80 interpreters take a minute
        try:
            code = cli.main(list(args))
        except SystemExit as exc:
            code = exc.code
        except BaseException:  # what would have been a traceback
            code = "traceback: " + traceback.format_exc()[-600:]
        out, err = capsys.readouterr()
        if code in (0, None) or not isinstance(code, int) or len(err.splitlines()) != 1 or out:
            wrong.append(f"stripefs {' '.join(args)}: exit {code}, stdout {out[:200]!r}, stderr {err[-600:]!r}")
    assert not wrong, "\n".join(wrong)
    assert not (tmp_path / "b.db").exists() and not _is_mounted(empty) and not _is_mounted(full)
    # and as the interpreter runs them: a usage error, a role's own parser, a user error
    for args in (["layout", "set", str(tmp_path), "--replicas", "x"], ["storage"], ["keygen", str(a_file / "k")]):
        res = run_cli(*args, check=False, cwd=tmp_path, env=_clean_env())
        assert res.returncode == 1 and len(res.stderr.splitlines()) == 1 and "Traceback" not in res.stderr, (args, res.stderr)


def test_bad_values_say_what_is_wrong(tmp_path):
    """The messages of the cases above that the issue quoted, word for word what they must say."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "old").write_text("x")
    env = _clean_env()

    def err(*args):
        return run_cli(*args, check=False, cwd=tmp_path, env=env).stderr

    assert "'abc' is not a size" in err("layout", "set", str(tmp_path), "--chunk-size", "abc")
    assert "'-1M' is not a size" in err("layout", "set", str(tmp_path), "--chunk-size=-1M")
    out = err("mount", "tcp://127.0.0.1:1", str(a_file))
    assert "is not a directory" in out and "mkdir" not in out
    assert "mkdir -p" in err("mount", "tcp://127.0.0.1:1", str(tmp_path / "missing"))
    out = err("mount", "tcp://127.0.0.1:1", str(full))
    assert "not empty" in out and "-o nonempty" in out
    assert "disk_cache_dir" in err("mount", "tcp://127.0.0.1:1", str(tmp_path), "-o", "cache_dir=/x")
    assert "pyfuse3 was removed" in err("mount", "tcp://127.0.0.1:1", str(tmp_path), "-o", "fuse_session=pyfuse3")
    for args in (["status", str(tmp_path)], ["layout", "get", str(tmp_path)], ["quota", "get", str(tmp_path)]):
        assert f"{tmp_path} is not inside a stripefs mount" in err(*args), args
    out = err("meta", "backup", str(tmp_path / "b.db"))
    assert "--config" in out and "--dir" in out and "./.stripefs" in out


def test_keygen_creates_the_directory_of_the_readme_example(tmp_path):
    base = tmp_path / "etc" / "stripefs" / "keys" / "gpu-nodes"
    out = run_cli("keygen", str(base)).stdout
    assert base.with_name("gpu-nodes.key").exists() and f"{base}.key_secret" in out
    assert (base.parent.stat().st_mode & 0o777) == 0o700 and (base.with_name("gpu-nodes.key_secret").stat().st_mode & 0o777) == 0o600
    secret = tmp_path / "other" / "cap_secret"
    run_cli("cap-secret", str(secret))
    assert secret.exists()


def test_a_closed_pipe_ends_quietly():
    """'stripefs config example client | head -1': the reader goes away; no BrokenPipeError traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE
    try:
        res = subprocess.run([sys.executable, "-m", "stripefs", "config", "example", "client"], stdout=write_end,
                             stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert res.stderr == "" and res.returncode != 0


def test_one_name_for_the_disk_cache():
    """client.toml's key, the mount option and the README use one name."""
    example = run_cli("config", "example", "client").stdout
    assert "\ndisk_cache_dir = " in example
    assert "disk_cache_dir=DIR" in run_cli("mount", "--help").stdout
    readme = (REPO / "README.md").read_text()
    assert "disk_cache_dir" in readme and "cache_dir" not in readme.replace("disk_cache_dir", "")


def test_local_down_trusts_no_other_users_command_line(tmp_path):
    """Security issue 28: a local user (uid 65534) starts a process whose command line claims to be the
    mount of the cluster in STATE, serving a tmpfs root mounted; 'local down' run as root must neither
    unmount that tmpfs (fusermount3 -u as root unmounts anything) nor signal the process."""
    if os.geteuid() != 0:
        pytest.skip("the attack is on root running 'local down'")
    state = tmp_path / "state"
    state.mkdir()
    claimed = tmp_path / "claimed"
    claimed.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(claimed)], check=True)
    decoy = None
    try:
        decoy = subprocess.Popen(
            ["/usr/bin/python3", "-c", "import time; time.sleep(120)", "-m", "stripefs", "mount", "tcp://127.0.0.1:1",
             str(claimed), "--pidfile", str(state / "mount.pid")],
            user=65534, group=65534, cwd="/", stdin=subprocess.DEVNULL)
        res = run_cli("local", "down", "--dir", str(state), check=False)
        assert res.returncode == 0, res.stderr
        assert _is_mounted(claimed), f"local down unmounted another user's tmpfs: {res.stdout} {res.stderr}"
        assert decoy.poll() is None, "local down signalled another user's process"
    finally:
        if decoy is not None:
            decoy.kill()
            decoy.wait()
        subprocess.run(["umount", "-l", str(claimed)], capture_output=True)


# -- on the session cluster --------------------------------------------------------------------


def test_status_through_a_closed_pipe(cluster):
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        res = subprocess.run([sys.executable, "-m", "stripefs", "status", str(cluster.mnt)], stdout=write_end,
                             stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert "Traceback" not in res.stderr and res.stderr == ""


def test_a_path_outside_any_mount_is_not_the_local_cluster(cluster, tmp_path):
    """From a directory whose ./.stripefs is a running local cluster (the repository after 'make run'),
    a path outside every mount is an error, not that cluster; without a path it is that cluster."""
    (tmp_path / ".stripefs").symlink_to(cluster.state)
    env = _clean_env()
    for args in (["status", "/tmp"], ["layout", "get", "/tmp"], ["quota", "list", "/tmp"]):
        res = run_cli(*args, check=False, cwd=tmp_path, env=env)
        assert res.returncode == 1 and res.stderr.strip() == (
            f"stripefs: /tmp is not inside a stripefs mount; " + res.stderr.strip().split("mount; ", 1)[1]), args
        assert res.stdout == ""
    assert "storage nodes up" in run_cli("status", cwd=tmp_path, env=env).stdout
    # a namespace path with --dir: looked up in the cluster, and a missing one is named as a path
    res = run_cli("layout", "get", "/no-such-dir", "--dir", str(cluster.state), check=False, env=env)
    assert res.returncode == 3 and "/no-such-dir: no such file or directory in the cluster's namespace" in res.stderr


def test_quota_set_on_a_file_names_the_path(cluster, mnt):
    f = mnt / "a-file"
    f.write_bytes(b"x")
    res = run_cli("quota", "set", str(f), "--bytes", "1M", check=False)
    assert res.returncode == 1 and f"{f} is not a directory" in res.stderr and "inode" not in res.stderr


def test_scrub_of_a_path_verifies_it_now(cluster, mnt):
    (mnt / "one").write_bytes(os.urandom(10_000))
    res = run_cli("scrub", str(mnt))
    assert "scrub: 1 file," in res.stdout and "0 bad copies" in res.stdout


def test_layout_convert_that_cannot_fit_is_one_line(cluster, mnt):
    for i in range(3):
        (mnt / f"f{i}").write_bytes(os.urandom(1000))
    res = run_cli("layout", "convert", "-r", str(mnt), "--ec", "4+2", check=False)
    assert res.returncode == 3 and len(res.stderr.splitlines()) == 1 and "Traceback" not in res.stderr, res.stderr
    assert "6" in res.stderr and "storage nodes" in res.stderr


def test_mount_over_a_non_empty_directory_needs_nonempty(cluster):
    over = cluster.root / "over"
    over.mkdir()
    (over / "old").write_text("kept")
    res = run_cli("mount", cluster.meta_address, str(over), check=False)
    if _is_mounted(over):  # what this test is against: leave nothing mounted
        cluster.extra_mounts.append(over)
    assert res.returncode == 1 and "not empty" in res.stderr and not _is_mounted(over)
    mnt = cluster.mount_again("over", "nonempty")
    try:
        assert _is_mounted(mnt) and not (mnt / "old").exists()
    finally:
        cluster.unmount(mnt)
    assert (over / "old").read_text() == "kept"


def test_meta_backup_finds_the_local_cluster_of_the_current_directory(cluster, tmp_path):
    (tmp_path / ".stripefs").symlink_to(cluster.state)
    out = run_cli("meta", "backup", "copy.db", cwd=tmp_path, env=_clean_env()).stdout
    assert "backed up" in out and (tmp_path / "copy.db").stat().st_size > 0


def test_tier_migrate_to_a_tier_that_does_not_exist_fails(cluster, mnt):
    """Issue 36 item 4: the daemon's "no tier named ..." was taken for "file deleted meanwhile", and the
    command said every file had moved (exit 0)."""
    d = mnt / "to-nowhere"
    d.mkdir()
    for i in range(3):
        (d / f"f{i}").write_bytes(b"x" * 1000)
    res = run_cli("tier", "migrate", "-r", str(d), "--to", "nosuchtier", check=False)
    assert res.returncode == 3, res.stdout
    assert "no tier named 'nosuchtier'" in res.stdout and "3 failed" in res.stdout, res.stdout
    assert "0 file(s) moved" in res.stdout, res.stdout


def test_layout_set_mistakes_exit_1_and_ec_says_where_it_pays(cluster, mnt):
    """Issue 36 items 8 and 14: '--chunk-size 0' exited 3 and '--replicas 0' 1; 'layout set' on a file named
    an inode; '--ec' promised 1.5x without a word on small files (a file under chunk_size/K costs (1+M)x)."""
    d = mnt / "layouts"
    d.mkdir()
    (d / "file").write_bytes(b"x")
    for args in (["--chunk-size", "0"], ["--chunk-size", "66K"], ["--replicas", "0"], ["--stripe-count", "0"], ["--ec", "0+1"]):
        res = run_cli("layout", "set", str(d), *args, check=False)
        assert res.returncode == 1 and len(res.stderr.splitlines()) == 1, (args, res.returncode, res.stderr)
    res = run_cli("layout", "set", str(d / "file"), "--replicas", "2", check=False)
    assert res.returncode == 1 and f"{d / 'file'} is not a directory" in res.stderr and "inode" not in res.stderr, res.stderr
    out = run_cli("layout", "set", str(d), "--ec", "2+1", "--chunk-size", "4M").stdout
    assert "1.50x from 4.0M up" in out and "2.00x (as much as replicas=2) for files of 2.0M or less" in out, out
    assert "note:" not in run_cli("layout", "set", str(d), "--replicas", "2").stdout
    # and counts that cannot work: refused as usage errors, not accepted (item 14)
    for args in (["warmup", str(d), "--threads", "0"], ["top", str(mnt), "-n", "0", "--once"]):
        res = run_cli(*args, check=False)
        assert res.returncode == 1 and len(res.stderr.splitlines()) == 1, (args, res.returncode, res.stderr)
        assert "above 0" in res.stderr or "between 1" in res.stderr, (args, res.stderr)


def test_ctrl_c_stops_a_conversion_with_one_line(cluster, mnt):
    """Issue 36 item 9: Ctrl-C in 'layout convert -r' printed an exception group traceback, or was taken
    for one file's failure ("FAILED: the write failed: KeyboardInterrupt()") and the conversion went on."""
    import signal as _signal

    d = mnt / "to-convert"
    d.mkdir()
    for i in range(150):
        (d / f"f{i}").write_bytes(bytes([i % 256]) * 5000)
    proc = subprocess.Popen([sys.executable, "-m", "stripefs", "layout", "convert", "-r", str(d), "--ec", "2+1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # not a terminal: a line per file
        seen.append(line)
        if len(seen) >= 5:
            break
    proc.send_signal(_signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    err = "".join(seen) + err
    assert proc.returncode == 130, (out, err[-2000:])
    assert "Traceback" not in err and "KeyboardInterrupt" not in err + out, err[-2000:]
    assert "interrupted after" in out and "of 150 file(s)" in out and "run the command again" in out, out
    converted = int(out.split(": ", 1)[1].split(" converted")[0])
    assert converted < 150
    for i in range(150):  # every file whole, in its old layout or the new one
        assert (d / f"f{i}").read_bytes() == bytes([i % 256]) * 5000


def test_a_quota_beyond_what_the_daemon_holds_is_one_line(cluster, mnt):
    """Issue 36 item 10: 'quota set --bytes 99999999999P' ended in a traceback (OverflowError: can't
    serialize ints > 2**64 - 1)."""
    d = mnt / "huge-quota"
    d.mkdir()
    for args in (["--bytes", "99999999999P"], ["--bytes", "8192P"], ["--inodes", str(1 << 64)]):
        res = run_cli("quota", "set", str(d), *args, check=False)
        assert res.returncode == 1 and len(res.stderr.splitlines()) == 1 and "at most" in res.stderr, (args, res.stderr)
        assert "Traceback" not in res.stderr
    assert "bytes" in run_cli("quota", "set", str(d), "--bytes", "1024P").stdout


def test_fsck_and_node_find_the_cluster_from_inside_a_mount(cluster, mnt):
    """Issue 36 item 11: 'cd mnt/train; stripefs fsck' found no cluster, and 'stripefs fsck mnt' was
    'unrecognized arguments'."""
    d = mnt / "train"
    d.mkdir()
    env = _clean_env()
    for args, cwd in ((["fsck"], d), (["fsck", str(mnt)], "/"), (["node", "undrain", "1"], d),
                      (["node", "undrain", "1", str(d)], "/")):
        res = run_cli(*args, check=False, cwd=cwd, env=env)
        assert res.returncode in (0, 3) and "cannot find the cluster" not in res.stderr, (args, res.stderr)
        assert "fsck:" in res.stdout or "takes new chunks again" in res.stdout, (args, res.stdout, res.stderr)


def test_the_readmes_prefetch_counters_command_works(cluster, mnt):
    """Issue 36 item 13: the README's only way to read the counters was getfattr, which a fresh Debian
    lacks. Its Python one-liner runs as written (the mountpoint put in) and prints them."""
    readme = (REPO / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("python3 -c") and "user.stripefs.prefetch" in x)
    assert "apt-get install attr" in readme
    res = subprocess.run(["bash", "-c", line.replace("/mnt/data", str(mnt))], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip(), res.stderr


def test_ctrl_c_inside_a_nursery_is_one_line_saying_how_far(monkeypatch, capsys):
    """Issue 36 item 9, for every command: a KeyboardInterrupt that trio wrapped in an exception group
    printed ~60 lines of 'Exception Group Traceback'; now one line with the progress bar's count."""
    from stripefs.common.progress import Progress

    def interrupted(argv):
        bar = Progress(2000, label="migrate", stream=open(os.devnull, "w"))
        bar.update(93)
        raise BaseExceptionGroup("nursery", [KeyboardInterrupt()])

    monkeypatch.setattr(cli, "_dispatch", interrupted)
    assert cli.main(["tier", "migrate"]) == 130
    out, err = capsys.readouterr()
    assert err.splitlines() == ["stripefs: interrupted after 93 of 2,000 files (migrate); what was done stays done: "
                                "run the command again to finish"] and out == ""


def test_top_of_a_job_reading_from_the_page_cache_is_not_idle(cluster, mnt):
    """Issue 36 item 6, through the command: a warm loop (the kernel serves the bytes from its page cache,
    the mount sees only the buffered open's isatty() IOCTL, answered by the session itself) is not
    'idle: no reads'."""
    import threading

    f = mnt / "warm-for-top"
    f.write_bytes(b"w" * 100_000)
    f.read_bytes()
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            with open(f, "rb") as fh:
                fh.read()

    t = threading.Thread(target=reader)
    t.start()
    try:
        out = run_cli("top", str(cluster.mnt), "--once", "-n", "1").stdout
    finally:
        stop.set()
        t.join()
    verdict = next(line for line in out.splitlines() if line.startswith("=> "))
    assert "idle" not in verdict and "page cache" in verdict, out
