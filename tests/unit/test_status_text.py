"""What `stripefs status`, `stripefs local status` and `scrub` print: units, plurals, no 'pid None' (issue 17, item 8)."""

from stripefs import status
from stripefs.common import protocol as p
from stripefs.common.layout import format_size, parse_size
from stripefs.heal_cli import scrub_outcome


def _node(i: int, fs: str) -> p.NodeInfo:
    return p.NodeInfo(node_id=i, address=f"tcp://127.0.0.1:{7100 + i}", host=f"h{i}", state="up", capacity_bytes=1 << 40,
                      free_bytes=1 << 39, used_bytes=22, chunks=1, last_heartbeat_age_s=0.5, filesystem=fs)


def test_sizes_carry_a_unit_even_under_a_kibibyte():
    assert format_size(22) == "22B" and format_size(0) == "0B" and format_size(4 << 20) == "4.0M"
    assert parse_size(format_size(22)) == 22


def test_status_says_one_file_and_counts_a_shared_disk_once():
    rsp = p.StatusRsp(nodes=[_node(1, "m:1:9"), _node(2, "m:1:9")], files=1, directories=1, chunks=1, logical_bytes=22,
                      sessions=1, boot_id="b")
    text = status.render(rsp, "tcp://127.0.0.1:7100")
    assert "1 file, 1 directory, 1 chunk," in text and "1 mount" in text
    assert "1 files" not in text and "1 mounts" not in text
    s = status.to_json(rsp, "tcp://127.0.0.1:7100")
    assert s["capacity_bytes"] == 1 << 40 and s["free_bytes"] == 1 << 39 and s["used_bytes"] == 44


def test_local_status_names_a_stopped_process_and_units():
    procs = [
        {"role": "meta", "node_id": None, "pid": None, "address": "tcp://127.0.0.1:7100", "state": "down",
         "bytes_stored": None, "metrics": None},
        {"role": "storage", "node_id": 1, "pid": 4242, "address": "tcp://127.0.0.1:7101", "state": "up",
         "bytes_stored": 22, "metrics": None},
    ]
    text = status.render_local({"processes": procs, "under_replicated": None})
    assert "None" not in text and "not running" in text
    assert "pid 4242" in text and "22B stored" in text


def test_scrub_says_what_it_will_do_with_bad_copies():
    assert "443 being re-replicated" in scrub_outcome(443, 443) and "NOT" not in scrub_outcome(443, 443)
    none_good = scrub_outcome(443, 0)
    assert "re-replicat" not in none_good and "443 NOT repaired: no good copy" in none_good
    assert "400 being re-replicated" in scrub_outcome(443, 400) and "43 NOT repaired" in scrub_outcome(443, 400)
