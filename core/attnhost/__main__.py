"""``python -m attnhost`` and the ``attnhost`` console script: a command lives for a moment and frees nothing worth
collecting, so it runs without the cyclic collector, and the collection at exit skips what it loaded (BENCHMARKS.md,
"What makes it fast")."""

import gc


def run() -> int:
    gc.disable()
    from attnhost.cli import main

    try:
        return main()
    finally:
        gc.freeze()  # output is flushed by now, and the cache file was written long before
        gc.enable()


if __name__ == "__main__":
    raise SystemExit(run())
