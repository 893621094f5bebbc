"""Prints the name of each GPU torch sees, one a line (``env.gpu_names`` where nvidia-smi is
missing; in a subprocess, so the benchmark's process holds no CUDA context)."""
import torch

if __name__ == "__main__":
    for i in range(torch.cuda.device_count()):
        print(torch.cuda.get_device_name(i))
