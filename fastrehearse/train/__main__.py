"""`torchrun --nproc_per_node=N -m fastrehearse.train --config PATH [--set k=v] [--resume]`."""
import sys

from fastrehearse.cli import train_main

if __name__ == "__main__":
    sys.exit(train_main(prog="python -m fastrehearse.train"))
