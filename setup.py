"""MiniMind: a small Llama/Qwen3-family language model on the Hugging Face stack.

torch is deliberately not pinned to a build: install the torch that fits your machine first (the Makefile's
`install` target takes torch 2.13.0), then this package; any torch >= 2.4 satisfies it and pip adds nothing.
"""

from setuptools import find_packages, setup

# The installed commands: `minimind-<name>` runs `minimind.cli.<function>` (scripts/*.py run the same functions).
COMMANDS = {
    "pretrain": "pretrain",
    "sft": "sft",
    "lora": "lora",
    "dpo": "dpo",
    "reward": "reward",
    "distill": "distill",
    "prepare": "prepare",
    "grpo": "grpo",
    "demo": "demo",
    "chat": "chat",
    "serve": "serve",
    "export": "export",
    "push": "push_to_hub",
    "convert": "convert",
    "train-tokenizer": "train_tokenizer",
    "eval": "evaluate",
    "web": "web",
}

setup(
    name="minimind",
    version="0.1.0",
    description="MiniMind: train, load and serve a small Llama/Qwen3-style model with transformers",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    py_modules=["configuration_minimind", "modeling_minimind"],
    packages=find_packages(include=["minimind", "minimind.*"]),
    package_data={"minimind": ["eval_tasks/*.yaml", "eval_tasks/*.py"]},  # lm-eval task files, not a package
    entry_points={"console_scripts": [f"minimind-{name}=minimind.cli:{func}" for name, func in COMMANDS.items()]},
    install_requires=[
        "torch>=2.4",
        "transformers>=4.57,<6",
        "tokenizers>=0.22",
        "safetensors>=0.4",
        "accelerate>=1.0",
        "datasets>=3.0",
        "peft>=0.17",
        "trl>=1.16",
        "matplotlib>=3.8",  # every training run's loss plot, shown in the model card
    ],
    extras_require={
        "export": ["gguf>=0.19"],
        # `minimind-export --to onnx`: torch.onnx's dynamo exporter needs onnx and onnxscript; onnxruntime runs the
        # graph (the export checks its logits with it, and the tests decode with it). optimum is left out: optimum-onnx
        # 0.1.0 requires transformers<4.58.
        "onnx": ["onnx>=1.23", "onnxscript>=0.7", "onnxruntime>=1.32"],
        "llama_cpp": ["llama-cpp-python>=0.3.36"],
        "serve": ["fastapi>=0.110", "uvicorn>=0.29"],
        "eval": ["lm-eval>=0.4.13"],
        "web": ["gradio>=6.0"],
        "int8": ["torchao>=0.18"],  # int8 decoding (minimind-chat --int8)
        "mutate": ["mutmut==3.8.1"],  # `make mutate`: mutation testing, not part of `make test`
        # playwright drives the system's chromium (apt install chromium) in the web page's browser test
        # pytest-xdist: `make test` runs the suite in two worker processes (PYTEST_WORKERS)
        # pytest-timeout: a test that hangs fails alone, named, with every thread's stack (pyproject.toml)
        # ruff: `make test` checks lint and format first; pinned so that every machine formats alike
        # tensorboard: the `--report_to tensorboard` test
        # onnx, onnxscript, onnxruntime: `minimind-export --to onnx` and its test (tests/export/test_onnx.py)
        "dev": [
            "ruff==0.17.6",
            "tensorboard>=2.15",
            "pytest>=8",
            "pytest-xdist>=3.5",
            "pytest-timeout>=2.3",
            "gguf>=0.19",
            "fastapi>=0.110",
            "uvicorn>=0.29",
            "openai>=1.26",
            "httpx>=0.27",
            "lm-eval>=0.4.13",
            "gradio>=6.0",
            "playwright>=1.40",
            "torchao>=0.18",
            "onnx>=1.23",
            "onnxscript>=0.7",
            "onnxruntime>=1.32",
        ],
    },
)
