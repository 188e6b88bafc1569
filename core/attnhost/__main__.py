"""``python -m attnhost`` and the ``attnhost`` console script: the CLI as a program.

A command lives for a moment and frees nothing worth collecting, so the program runs without the cyclic
garbage collector from its first import on, and lets the collection at exit skip everything it loaded
(BENCHMARKS.md). :func:`attnhost.cli.main` itself leaves the collector alone, for in-process callers.
"""

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
