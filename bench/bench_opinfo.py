"""PyTorch's OpInfo database on ``ember`` vs local CPU torch (see ``ember.bench.opinfo``).

    python bench/bench_opinfo.py run --pass forward [--every] [--start 0 --stop 100] [--ops abs,add]
                                     [--peer ws] --out results.jsonl
    python bench/bench_opinfo.py table results*.jsonl
"""

from ember.bench.opinfo_cli import main

if __name__ == "__main__":
    main()
