"""bench/meta.py's table: one row per figure, the issue's goal rows first,
each stripefs figure beside the local disk's from the same run (for the
round trip: beside the bare pyzmq floor), the ratio, the goal and PASS/BELOW.

Ratios are stripefs / local. For rates (ops/s, files/s, MiB/s) higher is
better; for ms rows (CPU per create, round trips) lower is better.
"""

from __future__ import annotations

# issue 15 "Done when": (row, configuration) -> (kind, value).
#   min: stripefs >= value; max: stripefs <= value; ratio: stripefs / local >= value;
#   time: stripefs takes at most value x the local disk's time (rate ratio >= 1 / value)
GOALS = {
    ("create", "sqlite"): ("min", 3000),
    ("unlink", "sqlite"): ("min", 3000),
    ("mkdir", "sqlite"): ("min", 3000),
    ("rename", "sqlite"): ("min", 2000),
    ("stat warm", "sqlite"): ("ratio", 0.3),
    ("stat", "sqlite"): ("min", 5000),
    ("readdir warm", "sqlite"): ("ratio", 0.3),
    ("mkdir -p", "sqlite"): ("min", 3000),  # the issue's mkdir goal, for each directory of a chain
    ("cp -r", "sqlite"): ("ratio", 0.3),
    ("rm -rf", "sqlite"): ("min", 2000),
    ("walk cold@default", "sqlite"): ("time", 1.5),
    ("walk warm@default", "sqlite"): ("time", 1.5),
    ("walk cold@dataset", "sqlite"): ("time", 1.5),
    ("walk warm@dataset", "sqlite"): ("time", 1.5),
    ("procs create", "sqlite"): ("min", 4000),
    ("records", "sqlite"): ("min", 50),
    ("cpu daemon", "sqlite"): ("max", 0.3),
    ("rtt ping", "sqlite"): ("max", 0.35),
    ("rtt getattr", "sqlite"): ("max", 0.35),
    ("create", "pg2"): ("min", 1000),
    # issue 30, the daemon at wire speed
    ("i30 cpu create", "sqlite"): ("max", 0.25),
    ("i30 cpu create", "pg1"): ("max", 1.0),
    ("i30 cpu create", "pg2"): ("max", 1.0),
    ("i30 cpu batch64", "sqlite"): ("max", 0.08),
    ("i30 rtt getattr median", "sqlite"): ("max", 0.15),
    ("i30 rtt getattr p99", "sqlite"): ("max", 1.0),
    ("i30 rtt thread getattr median", "sqlite"): ("max", 0.15),
    ("i30 rtt thread getattr p99", "sqlite"): ("max", 1.0),
    ("i30 create", "sqlite"): ("min", 7500),
    ("i30 procs create", "sqlite"): ("min", 10000),
    ("i30 procs create 2 mounts", "sqlite"): ("min", 10000),
    ("i30 create", "pg2"): ("min", 1500),
    ("i30 wire cpu", "pg1"): ("max", 1.0),
    ("i30 wire cpu", "pg2"): ("max", 1.0),
    ("i30 wire create", "pg2"): ("min", 1500),
    # issue 31, files written in batches
    ("i31 create", "sqlite"): ("min", 7500),
    ("i31 unlink", "sqlite"): ("min", 9000),
    ("i31 mkdir", "sqlite"): ("min", 7500),
    ("i31 rename", "sqlite"): ("min", 2000),
    ("i31 rm -rf", "sqlite"): ("ratio", 1.0),
    ("i31 stat written", "sqlite"): ("ratio", 0.3),
    ("i31 cp -r", "sqlite"): ("ratio", 0.3),
    ("i31 cpu ingest", "sqlite"): ("max", 1.5),
    ("i31 mdtest create", "sqlite"): ("min", 5000),
    ("i31 mdtest stat", "sqlite"): ("min", 20000),
    ("i31 mdtest remove", "sqlite"): ("min", 5000),
}

OP_LABELS = {
    "create": "create (open O_CREAT|O_EXCL + close)",
    "unlink": "unlink",
    "mkdir": "mkdir",
    "rename": "rename (into another directory)",
    "stat warm": "stat, warm",
    "stat": "stat, cold (dentries dropped: a LOOKUP each)",
    "readdir warm": "readdir (scandir), warm",
    "mkdir -p": "mkdir -p chains (os.makedirs)",
    "rmdir": "rmdir",
    "stat written": "stat of files this mount just wrote (4 KiB each)",
}
OP_UNITS = {"readdir warm": "entries/s", "mkdir -p": "dirs/s"}
ISSUE_ORDER = ("create", "unlink", "mkdir", "rename", "stat warm", "stat", "readdir warm", "mkdir -p")


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "ms":
        return f"{v:.3f} ms"
    if unit == "MiB/s":
        return f"{v:,.1f} MiB/s"
    return f"{v:,.0f}{unit}" if unit == "/s" else f"{v:,.0f} {unit}"


def _goal(goal: tuple | None, unit: str) -> str:
    if goal is None:
        return "-"
    kind, value = goal
    if kind == "ratio":
        return f">= {value:.2f}x local"
    if kind == "time":
        return f"time <= {value:.1f}x local"
    rel = ">=" if kind == "min" else "<="
    return f"{rel} {value:.2f} ms" if unit == "ms" else f"{rel} {_fmt(value, unit)}"


def _verdict(goal: tuple | None, stripefs: float | None, ratio: float | None) -> bool | None:
    if goal is None or stripefs is None:
        return None
    kind, value = goal
    if kind == "min":
        return stripefs >= value
    if kind == "max":
        return stripefs <= value
    if ratio is None:
        return None
    return ratio >= (value if kind == "ratio" else 1 / value)


def rows_of(key: str, res: dict, args) -> list[dict]:
    """Every figure of one configuration's results, as table rows (issue order)."""
    rows = []

    def add(row: str, label: str, stripefs: float | None, local: float | None, unit: str) -> None:
        ratio = stripefs / local if stripefs is not None and local else None
        goal = GOALS.get((row, key))
        rows.append({"config": key, "row": row, "label": label, "unit": unit, "stripefs": stripefs, "local": local,
                     "ratio": ratio, "goal": _goal(goal, unit), "pass": _verdict(goal, stripefs, ratio)})

    if "stripefs_ops_s" in res:
        for op in ISSUE_ORDER + ("rmdir", "stat written"):
            label = OP_LABELS[op] + (f", {args.chains} x depth {args.depth}" if op == "mkdir -p" else "")
            add(op, label, res["stripefs_ops_s"][op], res["local_ops_s"][op], OP_UNITS.get(op, "/s"))
    ing = res.get("ingest")
    if ing:
        size = f"{ing['files']:,} files ~110 KiB in {ing['classes']} dirs"
        add("cp -r", f"ingest: cp -r + sync -f, {size}", ing["cp"]["stripefs"]["rate"], ing["cp"]["local"]["rate"],
            "files/s")
        add("rm -rf", "rm -rf of that tree", ing["rm"]["stripefs"]["rate"], ing["rm"]["local"]["rate"], "files/s")
        for mode in ("default", "dataset"):
            for temp in ("cold", "warm"):
                w = ing["walk"].get(f"{temp}@{mode}")
                if w:
                    add(f"walk {temp}@{mode}", f"ImageFolder index walk, {temp}, {mode} mount",
                        w["stripefs"]["rate"], w["local"]["rate"], "files/s")
    if "procs" in res:
        p = res["procs"]
        add("procs create", f"create, 2 processes on one mount, {p['per_process']:,} each",
            p["stripefs"]["rate"], p["local"]["rate"], "/s")
    if "records" in res:
        r = res["records"]
        add("records", f"2 writers, 1 file, interleaved {r['record_bytes']:,} B records, "
            f"{r['records'] * r['record_bytes'] / (1 << 20):.0f} MiB + fsync",
            r["stripefs"]["mib_per_s"], r["local"]["mib_per_s"], "MiB/s")
    cpu = res.get("cpu_per_create_ms")
    if cpu:
        add("cpu daemon", "CPU per create: metadata daemon(s) (utime+stime)", cpu["daemon"], cpu["local"], "ms")
        add("cpu mount", "CPU per create: the mount(s)", cpu["mount"], cpu["local"], "ms")
    t = res.get("transport")
    if t:
        floor = t["floor"]["mean_ms"]
        add("rtt ping", "round trip at the client: PingReq to the daemon", t["ping"]["mean_ms"], floor, "ms")
        add("rtt getattr", "round trip at the client: GetattrReq of /", t["getattr"]["mean_ms"], floor, "ms")
        add("rtt client share", "round trip: RpcClient to a minimal server", t["client_share"]["mean_ms"], floor, "ms")
    _issue30_rows(key, res, add)
    _issue31_rows(res, add)
    return rows


def _issue31_rows(res: dict, add) -> None:
    """Issue 31's goals (files written in batches), beside the same local figures."""
    ops, local = res.get("stripefs_ops_s"), res.get("local_ops_s", {})
    if ops:
        for op in ("create", "unlink", "mkdir", "rename", "stat written"):
            if op in ops:
                add(f"i31 {op}", f"issue 31: {OP_LABELS[op]}", ops[op], local.get(op), OP_UNITS.get(op, "/s"))
    ing = res.get("ingest")
    if ing:
        add("i31 cp -r", "issue 31: cp -r 110 KiB files + sync -f", ing["cp"]["stripefs"]["rate"], ing["cp"]["local"]["rate"],
            "files/s")
        add("i31 rm -rf", "issue 31: rm -rf of that tree", ing["rm"]["stripefs"]["rate"], ing["rm"]["local"]["rate"], "files/s")
        cpu = ing.get("cpu_per_file_ms")
        if cpu:
            add("i31 cpu ingest", "issue 31: CPU per 110 KiB file ingested, all processes", sum(cpu["stripefs"].values()),
                sum(cpu["local"].values()), "ms")
    md = res.get("mdtest")
    if md:
        for phase in ("create", "stat", "remove"):
            add(f"i31 mdtest {phase}", f"issue 31: mdtest-easy {phase}, 2 processes, {md['per_process']:,} empty files each",
                md["stripefs"][phase]["rate"], md["local"][phase]["rate"], "files/s")


def _issue30_rows(key: str, res: dict, add) -> None:
    """Issue 30's goals (the daemon at wire speed), beside the same local figures."""
    cpu, t = res.get("cpu_per_create_ms"), res.get("transport") or {}
    if cpu:
        add("i30 cpu create", "issue 30: daemon CPU per create (through the mount)", cpu["daemon"], cpu["local"], "ms")
    for key, label in (("creates_single", "daemon CPU per create, CreateReq straight to it, 64 in flight"),
                       ("creates_batch64", "issue 30: daemon CPU per create in a BatchReq of 64")):
        c = t.get(key)
        if c and c.get("daemon_cpu_ms") is not None:
            add("i30 cpu batch64" if key == "creates_batch64" else "i30 cpu wire", label, c["daemon_cpu_ms"],
                cpu["local"] if cpu else None, "ms")
            add(f"i30 rate {key}", "  the same: creates/s", c["per_s"], res.get("local_ops_s", {}).get("create"), "/s")
    if "getattr" in t:
        floor = t["floor"]
        add("i30 rtt getattr median", "issue 30: GetattrReq round trip at the client, median", t["getattr"]["median_ms"],
            floor["median_ms"], "ms")
        add("i30 rtt getattr p99", "issue 30: GetattrReq round trip at the client, p99", t["getattr"]["p99_ms"],
            floor["p99_ms"], "ms")
    if "blocking_getattr" in t:  # the mount's client for plain threads (client/meta_blocking.py)
        floor, b = t["floor"], t["blocking_getattr"]
        add("i30 rtt thread getattr median", "issue 30: the same, the mount's thread client, median", b["median_ms"],
            floor["median_ms"], "ms")
        add("i30 rtt thread getattr p99", "issue 30: the same, the mount's thread client, p99", b["p99_ms"],
            floor["p99_ms"], "ms")
    if "stripefs_ops_s" in res:
        who = "one process, default mount" if res["clients"] == 1 else f"{res['clients']} mounts at once, aggregate"
        add("i30 create", f"issue 30: creates/s, {who}", res["stripefs_ops_s"]["create"],
            res["local_ops_s"]["create"], "/s")
    w = res.get("wire")
    if w:
        who = f"{w['daemons']} daemon(s) at once" + (", aggregate" if w["daemons"] > 1 else "")
        add("i30 wire create", f"issue 30: creates/s, BatchReq of 64 straight to {who}", w["per_s"], w["local_per_s"], "/s")
        add("i30 wire cpu", "issue 30: daemon CPU per create, those BatchReqs", w["daemon_cpu_ms"],
            cpu["local"] if cpu else None, "ms")
    if "procs" in res:
        add("i30 procs create", "issue 30: creates/s, 2 processes, one mount", res["procs"]["stripefs"]["rate"],
            res["procs"]["local"]["rate"], "/s")
        two = res["procs"].get("two_mounts")
        if two:  # the issue's own row
            add("i30 procs create 2 mounts", "issue 30: creates/s, 2 processes, 2 mounts", two["stripefs"]["rate"],
                two["local"]["rate"], "/s")


def report(results: dict, args, total_s: float) -> tuple[str, list[dict]]:
    """The table and the notes under it; the rows (for the JSON)."""
    rows: list[dict] = []
    lines = ["", "issue 15, metadata at the kernel's speed: stripefs beside the local disk, same run "
                 "(ratio = stripefs / local: for rates higher is better, for ms lower is better)", ""]
    header = f"  {'workload':64s} {'stripefs':>17s} {'local disk':>17s} {'ratio':>8s}  {'goal':<20s} verdict"
    for key, res in results.items():
        mine = rows_of(key, res, args)
        if not mine:
            continue
        rows += mine
        who = "one thread" if res["clients"] == 1 else f"{res['clients']} mounts, one thread each, at once"
        lines += [f"{res['label']} (namespace operations: {who}, {res['files']:,} files):", header]
        for r in mine:
            local = _fmt(r["local"], r["unit"])
            ratio = f"{r['ratio']:.3f}x" if r["ratio"] is not None else "-"
            verdict = {True: "PASS", False: "BELOW", None: "-"}[r["pass"]]
            lines.append(f"  {r['label']:64s} {_fmt(r['stripefs'], r['unit']):>17s} {local:>17s} {ratio:>8s}  "
                         f"{r['goal']:<20s} {verdict}")
        lines.append("")
    lines += _notes(results, args)
    passed = sum(1 for r in rows if r["pass"] is True)
    below = [r for r in rows if r["pass"] is False]
    lines.append(f"goals: {passed} PASS, {len(below)} BELOW; total time {total_s:.0f}s")
    return "\n".join(lines), rows


def _notes(results: dict, args) -> list[str]:
    out = ["notes:",
           "  stat cold: drop_caches 2 first; index walk cold: drop_caches 3 (default mount: the same client;",
           "  dataset mount: `local down`, drop_caches, `local up -o dataset`, a fresh client), warm walks repeated"
           " for >= 0.3 s;",
           "  CPU per create, local disk column: this process's CPU per create on the local disk (the kernel's work);",
           "  round trips: mean of sequential calls; the local column is a bare pyzmq DEALER/ROUTER round trip "
           "(the floor)"]
    for key, res in results.items():
        t = res.get("transport")
        if t:
            out.append("  round trips, median / p99 ms: " + ", ".join(
                f"{name} {t[name]['median_ms']:.3f} / {t[name]['p99_ms']:.3f}"
                for name in ("floor", "client_share", "ping", "getattr", "lookup", "blocking_getattr", "blocking_lookup")
                if name in t))
        cpu = res.get("cpu_create_s")
        if cpu:
            out.append(f"  [{key}] CPU s in the create phase: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(cpu.items()))
                       + (" (postgres: the server and its backends; not in the daemon's figure)" if "postgres" in cpu else ""))
        ing_cpu = (res.get("ingest") or {}).get("cpu_per_file_ms")
        if ing_cpu:
            out.append(f"  [{key}] CPU ms per file ingested (cp -r + sync -f, then the write-back settled), by process: "
                       + "; ".join(f"{side}: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(c.items()))
                                   for side, c in ing_cpu.items()))
        for walk, w in (res.get("ingest") or {}).get("walk", {}).items():
            counts = w.get("requests_per_file")
            if counts is not None:
                out.append(f"  [{key}] index walk {walk}, stripefs requests per file: "
                           + (", ".join(f"{k} {v:g}" for k, v in counts.items()) or "none"))
        if res.get("loadavg"):
            out.append(f"  [{key}] load average (1 min) at the start of each group: "
                       + ", ".join(f"{g} {v:.1f}" for g, v in res["loadavg"].items()))
        for p in res.get("log_problems", []):
            out.append(f"  [{key}] stripefs log: {p}")
    return out
