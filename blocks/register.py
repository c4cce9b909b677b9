"""Register the eagle3 block types with the Prefect API in PREFECT_API_URL (or the embedded one).

    python -m eagle3_prefect.blocks.register [--example]

Same as `prefect block register -m eagle3_prefect.blocks.eagle3_blocks`. --example also saves
documents named "demo" (local target path from configs/demo.yaml, storage under runs/, a 1-GPU
profile).
"""

from __future__ import annotations

import argparse

from eagle3_prefect.blocks.eagle3_blocks import (
    BLOCK_TYPES,
    HardwareProfile,
    StorageLocation,
    TargetModelSource,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eagle3_prefect.blocks.register", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--example", action="store_true", help='also save example blocks named "demo"'
    )
    args = parser.parse_args(argv)
    for cls in BLOCK_TYPES:
        cls.register_type_and_schema()
        print(f"registered block type {cls.get_block_type_slug()}")
    if args.example:
        TargetModelSource(path="runs/demo/target").save("demo", overwrite=True)
        StorageLocation(base_path="runs").save("demo", overwrite=True)
        HardwareProfile(work_pool="gpu-1x", num_gpus=1, tensor_parallel_size=1).save(
            "demo", overwrite=True
        )
        print('saved example blocks named "demo"')
    from eagle3_prefect.blocks.alerts import drain_events

    drain_events()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
