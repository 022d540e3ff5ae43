"""`torchrun --nproc_per_node=N -m fastrehearse.train --config PATH [--set k=v] [--resume]`."""
import sys

from fastrehearse.cli import train_main, worker_exit

if __name__ == "__main__":
    sys.exit(worker_exit(train_main(prog="python -m fastrehearse.train")))
