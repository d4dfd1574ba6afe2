"""train.py end to end: runs that resume, several processes, faults, FSDP checkpoints, Slurm."""
