"""CPU the UI spends on a flood of hits: 30,000 pushed hits (as a training that hits every step
for a long run sends), then the UI left idle. Prints the UI process's CPU seconds for each part.

    python benchmarks/tui_hit_flood.py [--hits 30000] [--rate 3000]

The hits come from the numpy-only FakeSource of the tests, so only the UI's cost is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fake_source import FakeSource

from tensordbg.transport.client import LocalClient
from tensordbg.tui.app import TensorDbgApp
from tensordbg.tui.components.hit_table import HitTable


async def flood(hits: int, rate: float) -> tuple[float, float, float]:
    source = FakeSource()
    app = TensorDbgApp(LocalClient(source))
    async with app.run_test(size=(160, 48)) as pilot:
        table = app.query_one(HitTable)
        while not (app.state == "paused" and table.row_count == 2):
            await asyncio.sleep(0.01)
        passed_on = source.hits()[1]
        cpu, wall = time.process_time(), time.perf_counter()
        batch = max(1, int(rate / 50))
        for i in range(0, hits, batch):
            for j in range(i, min(i + batch, hits)):
                source.emit("hit", dict(passed_on, id=2 + j, step=4 + j // 20))
            await asyncio.sleep(0.02)
        while table.row_count < hits + 2:
            await asyncio.sleep(0.01)
        flood_cpu, flood_wall = time.process_time() - cpu, time.perf_counter() - wall
        cpu = time.process_time()
        await pilot.press("end", "up", "up", "pageup", "home")
        await asyncio.sleep(3.0)
        idle_cpu = time.process_time() - cpu
    return flood_cpu, flood_wall, idle_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hits", type=int, default=30_000)
    parser.add_argument("--rate", type=float, default=3000.0, help="hits pushed per second")
    args = parser.parse_args()
    flood_cpu, flood_wall, idle_cpu = asyncio.run(flood(args.hits, args.rate))
    print(
        f"{args.hits:,} hits in {flood_wall:.1f} s: UI CPU {flood_cpu:.1f} s "
        f"({100 * flood_cpu / flood_wall:.0f} % of one core); then 3 s with keys: "
        f"{idle_cpu:.2f} s CPU"
    )


if __name__ == "__main__":
    main()
