"""`torchrun --nproc_per_node=N -m fastrehearse.train --config PATH [--set k=v] [--resume]`."""
import sys

from fastrehearse.cli import train_main
from fastrehearse.train.parallelize import exit_worker

if __name__ == "__main__":
    sys.exit(exit_worker(train_main(prog="python -m fastrehearse.train")))
