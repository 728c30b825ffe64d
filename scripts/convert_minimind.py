"""Import an upstream MiniMind .pth checkpoint: the `minimind-convert` command, run from a checkout.

python scripts/convert_minimind.py --pth full_sft_768.pth --output_dir runs/upstream-768 --hidden_size 768
"""

from minimind.cli import convert as main

if __name__ == "__main__":
    main()
