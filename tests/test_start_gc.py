"""The garbage collector at a process's start-up (moe_rl/__init__.py): importing moe_rl raises the first
threshold where the process left Python's default, and `moe_rl.started` freezes what the imports made and
puts the default back (tools/bench/start_gc.py measures what the start-up threshold saves); and
`moe_rl.release_free_heap`, which ranks and engines call after each update and weight sync."""

import subprocess
import sys


def run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_importing_raises_the_first_threshold_and_started_freezes_and_puts_the_default_back():
    out = run("import gc, moe_rl; a = gc.get_threshold(); moe_rl.started(); "
              "print(a, gc.get_threshold(), gc.get_freeze_count() > 1000)")
    assert out == "(50000, 20, 20) (700, 10, 10) True"


def test_a_threshold_the_process_set_itself_is_kept():
    out = run("import gc; gc.set_threshold(5000, 5, 5); import moe_rl; a = gc.get_threshold(); "
              "moe_rl.started(); print(a, gc.get_threshold())")
    assert out == "(5000, 5, 5) (5000, 5, 5)"


def test_release_free_heap_hands_freed_small_blocks_back():
    """200 MiB in 4 kB blocks (below glibc's mmap threshold: they live in the heap), one kept above them so
    that the heap's top cannot shrink by itself: freed, they stay resident until the heap is trimmed."""
    out = run("import os, moe_rl\n"
              "def rss():\n"
              "    with open('/proc/self/statm') as f:\n"
              "        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') >> 20\n"
              "blocks = [bytearray(4000) for _ in range(50000)]; keep = bytearray(4000); full = rss()\n"
              "del blocks; freed = rss(); moe_rl.release_free_heap(); print(full, freed, rss())")
    full, freed, trimmed = map(int, out.split())
    assert freed > full - 50 and trimmed < full - 150
