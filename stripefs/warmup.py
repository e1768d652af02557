"""``stripefs warmup PATH... [--from-list FILE]``: load a dataset into the mount's caches.

Walks the given files and directories (listing a directory tells the kernel
every entry, so prefetched files can go straight into its page cache), hands
the small files to the mount's prefetcher in one go (stripefs/prefetch_control.py:
the mount fetches them in parallel into its memory cache, the page cache and
its disk cache when it has one), reads files too large for the prefetcher
itself with a few threads (the mount's read-ahead fills the caches), shows a
progress bar and ends with a report. Exit status 3 when some files could not
be loaded.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from .common.errors import QuietError
from .prefetch_control import MountRoots, announce, group_by_mount, report
from .common.progress import Progress

#: files above this are read by warmup itself (the mount's prefetcher leaves them to read-ahead)
LARGE_FILE = 16 << 20


def _threads(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of threads") from None
    if not 1 <= value <= 256:
        raise argparse.ArgumentTypeError(f"{text}: between 1 and 256 threads")
    return value


def add_parser(sub) -> None:
    warm = sub.add_parser(
        "warmup",
        help="load files into a mount's caches before a job reads them",
        description=(
            "Load files (directories recursively) into the caches of the stripefs mount holding them: "
            "the kernel's page cache, the mount's memory cache (cache_size) and its disk cache (disk_cache_dir). "
            "Files larger than the memory cache will not all stay in it."
        ),
        epilog="Example: stripefs warmup /mnt/data/imagenet/train --threads 4",
    )
    warm.add_argument("paths", nargs="*", metavar="PATH", help="files or directories inside a stripefs mount")
    warm.add_argument("--from-list", metavar="FILE", help="also the paths listed in FILE, one per line ('-': stdin)")
    warm.add_argument("--threads", type=_threads, default=4, help="readers for large files, 1..256 (default: %(default)s)")
    warm.set_defaults(func=cmd_warmup)


def _collect(args) -> list[tuple[str, int]]:
    roots = list(args.paths)
    if args.from_list:
        stream = sys.stdin if args.from_list == "-" else open(args.from_list)
        with stream:
            roots += [line.rstrip("\n") for line in stream if line.strip()]
    if not roots:
        raise QuietError("nothing to warm up: give PATHs or --from-list FILE")
    files: list[tuple[str, int]] = []
    for root in roots:
        if os.path.isdir(root):
            for dirpath, _, names in os.walk(root):
                for name in sorted(names):
                    path = os.path.join(dirpath, name)
                    try:
                        st = os.lstat(path)
                    except OSError:
                        continue
                    if st.st_mode & 0o170000 == 0o100000:
                        files.append((path, st.st_size))
        else:
            try:
                files.append((root, os.stat(root).st_size))
            except OSError as exc:
                raise QuietError(f"{root}: {exc.strerror}") from None
    return files


def _read_whole(path: str) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(4 << 20):
            n += len(chunk)
    return n


def cmd_warmup(args) -> int:
    files = _collect(args)
    by_root = group_by_mount((path for path, _ in files), MountRoots())
    if not by_root:
        raise QuietError("none of these paths is inside a stripefs mount")
    outside = len(files) - sum(len(v) for v in by_root.values())
    sizes = dict(files)
    small = [(p, s) for p, s in files if 0 < s <= LARGE_FILE]
    large = [(p, s) for p, s in files if s > LARGE_FILE]
    total_bytes = sum(s for _, s in small + large)
    progress = Progress(len(small) + len(large), label="warmup", total_bytes=total_bytes)

    try:
        before = {root: report(root) for root in by_root}
    except OSError as exc:
        raise QuietError(f"a mount here does not take prefetch requests ({exc.strerror}): is it an older stripefs?") from None
    # data in a cold tier (docs/tiering.md) comes back onto the storage nodes first, in parallel
    from .tier_cli import recall_for_warmup

    recall_failures: list[str] = []
    for root in by_root:
        mine = [p for p, _ in small + large if os.fsencode(os.path.abspath(p)).startswith(root)]
        recall_failures += recall_for_warmup(root, mine)[1]
    for line in recall_failures[:10]:
        print(line, file=sys.stderr)
    small_set = {os.fsencode(os.path.abspath(p)) for p, _ in small}
    for root, relative in by_root.items():
        wanted = [r for r in relative if os.path.join(root, r) in small_set]
        try:
            announce(root, wanted)
        except OSError as exc:
            raise QuietError(f"the mount at {os.fsdecode(root)} refused the file list: {exc.strerror} (run as the owner of the mount's root, or root)") from None

    large_done = large_bytes = large_failed = 0
    with ThreadPoolExecutor(args.threads) as pool:
        futures = [pool.submit(_read_whole, p) for p, _ in large]
        while True:
            counts = {root: report(root) for root in by_root}
            fetched = sum(counts[r]["fetched"] - before[r]["fetched"] for r in by_root)
            failed = sum(counts[r]["failed"] - before[r]["failed"] for r in by_root)
            pending = sum(counts[r]["pending"] for r in by_root)
            large_done = sum(f.done() for f in futures)
            large_bytes = sum(f.result() for f in futures if f.done() and not f.exception())
            large_failed = sum(1 for f in futures if f.done() and f.exception())
            small_done = min(len(small), fetched + failed)
            avg = (sum(s for _, s in small) / len(small)) if small else 0
            progress.update(small_done + large_done, int(small_done * avg) + large_bytes)
            if pending == 0 and large_done == len(large):
                break
            time.sleep(0.2)
    elapsed = progress.close()
    stored = sum(report(r)["stored"] - before[r]["stored"] for r in by_root)
    failures = failed + large_failed
    print(
        f"warmed {len(small) + len(large) - failures:,} of {len(files):,} files, {total_bytes / (1 << 20):,.1f} MiB "
        f"in {elapsed:.1f}s ({total_bytes / max(elapsed, 1e-6) / (1 << 20):,.0f} MiB/s); "
        f"{stored:,} pushed into the kernel's page cache"
        + (f"; {failures} failed (see the mount's log)" if failures else "")
        + (f"; {outside} outside any stripefs mount, skipped" if outside else "")
        + (f"; {sum(1 for s in sizes.values() if s == 0)} empty" if any(s == 0 for s in sizes.values()) else "")
    )
    return 3 if failures else 0
