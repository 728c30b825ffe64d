"""MiniMind from raw text to checked chat answers in about five minutes on a CPU: `minimind-demo` in a checkout.

python scripts/demo.py
"""

from minimind.cli import demo as main

if __name__ == "__main__":
    main()
