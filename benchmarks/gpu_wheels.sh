#!/usr/bin/env bash
# Wheels for a GPU machine that cannot download anything: the pinned packages of
# constraints/cpu.txt that its image lacks, or holds at a version this code was not run with,
# saved into .whl/ (git-ignored) for Python 3.12 on x86-64 Linux. Run it here, on a machine
# with the package registries; carry .whl/ there; benchmarks/gpu_check.sh installs them.
# The image's list is the lent H200's (torch 2.11 with CUDA, transformers 5.17, no Snakemake),
# as its notes gave it on 2026-11-17; torch is never carried (the image's CUDA build is used).
# Left out: torch, the image's own packages (but transformers, huggingface_hub, tokenizers and
# peft at this project's pins), and the formatters and test runner.
set -euo pipefail
image="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
  certifi charset-normalizer click cloudpickle contourpy cycler filelock fonttools frozenlist
  fsspec h11 hf-xet httpcore httpx idna iniconfig jinja2 kiwisolver markdown-it-py markupsafe
  matplotlib mdurl mpmath multidict mypy-extensions networkx numpy packaging pandas pathspec
  pillow pluggy propcache psutil pygments pyparsing python-dateutil pyyaml regex requests rich
  safetensors setuptools shellingham six sympy tabulate tqdm typer typing-extensions urllib3
  wrapt yarl"
skip="torch black snakefmt shfmt-py pytokens pytest pytest-timeout"
left_out=" $(echo $image $skip) "  # one space between names, and around them
mkdir -p .whl
wanted=$(mktemp)
while IFS= read -r line; do
    name=$(echo "${line%%==*}" | tr 'A-Z_.' 'a-z--')
    case "$line" in ""|\#*) continue ;; esac
    [[ "$left_out" == *" $name "* ]] && continue
    echo "$line" >> "$wanted"
done < constraints/cpu.txt
# --no-deps: every dependency is pinned in the constraints already; an sdist (connection_pool
# has no wheel) is built there with the image's setuptools (--no-build-isolation)
python3 -m pip download -q --no-deps --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl -r "$wanted"
echo "gpu_wheels: $(ls .whl | wc -l) files, $(du -sh .whl | cut -f1) in .whl/"
