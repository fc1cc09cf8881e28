"""Train the digits classifier from the command line or a YAML file, with any lightning_ddpx hook.

    python examples/cli_train.py fit --config examples/configs/powersgd.yaml
    python examples/cli_train.py fit --trainer.accelerator=cpu --trainer.devices=2 \\
        --trainer.strategy=lightning_ddpx.DDPXStrategy --trainer.strategy.comm_hook=powersgd \\
        --trainer.strategy.powersgd.matrix_approximation_rank=4
    python examples/cli_train.py fit --trainer.strategy=ddpx_fp16 ...   # a registered name works too
    python examples/cli_train.py fit --config examples/configs/fp16.yaml --print_config   # show the result

It is Lightning's own LightningCLI; importing lightning_ddpx is all it takes to make the strategy and its
registered names ("ddpx", "ddpx_powersgd", ...) available. With ``devices=2`` Lightning starts the second
process itself, by running this script again.
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningCLI

import lightning_ddpx  # noqa: F401 - registers DDPXStrategy's names with Lightning

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # digits.py lives next to this script
from digits import DigitsClassifier, DigitsDataModule  # noqa: E402


def main(args: list[str] | None = None) -> LightningCLI:
    return LightningCLI(
        DigitsClassifier,
        DigitsDataModule,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
