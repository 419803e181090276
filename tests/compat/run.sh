#!/usr/bin/env bash
# The core suite on other transformers releases, one venv each under .venv-compat/<version>.
#
# usage: tests/compat/run.sh [VERSION ...]     (default: the oldest supported release and the newest, the newest
#                                              with the newest accelerate and peft the package index has)
#        CORE_TESTS=tests/integration/trainers/test_trl.py tests/compat/run.sh trl==1.0.0   (another package, pinned)
#        tests/compat/run.sh accelerate==1.5.0                          (setup.py's accelerate floor)
#
# torch and the other dependencies are installed once, in .venv-compat/base; each release's venv sees
# them through a .pth file and installs only transformers and what that release pins differently
# (huggingface_hub, tokenizers). The package itself is imported from the working tree.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
ROOT=${COMPAT_ROOT:-.venv-compat}
# test_internals.py: every internal of transformers, accelerate, peft and torch the package relies on, on each release
CORE_TESTS=${CORE_TESTS:-"tests/integration/trainers/test_trainer.py tests/unit/trainers/test_training_args.py tests/unit/configuration/test_configuration.py tests/unit/trainers/test_mixin.py tests/unit/trainers/test_seq2seq.py tests/unit/trainers/test_internals.py"}
OLDEST=$(sed -n 's/.*"transformers>=\([0-9.]*\).*/\1/p' setup.py)
VERSIONS=("$@")
if [ ${#VERSIONS[@]} -eq 0 ]; then
	NEWEST=$("$PYTHON" -m pip index versions transformers 2>/dev/null | sed -n 's/^transformers (\(.*\))$/\1/p')
	# The oldest patch release of the oldest supported minor is what setup.py's lower bound admits.
	VERSIONS=("$OLDEST" "${NEWEST:?cannot list transformers releases: pass versions explicitly}")
fi

base="$ROOT/base"
if [ ! -f "$base/.installed" ]; then
	rm -rf "$base"
	"$PYTHON" -m venv "$base"
	"$base/bin/pip" install -q "torch==$TORCH_VERSION"
	"$base/bin/pip" install -q -e . pytest
	touch "$base/.installed"
fi
site=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

status=0
summary=()
for version in "${VERSIONS[@]}"; do
	requirement="transformers==$version"
	case "$version" in *==*) requirement=$version ;; esac
	venv="$ROOT/${version/==/-}"
	if [ ! -f "$venv/.installed" ]; then
		rm -rf "$venv"
		"$PYTHON" -m venv "$venv"
		own=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
		echo "import site; site.addsitedir('$(realpath "$site")')" >"$own/compat_base.pth"
		# pip leaves the base's own copies alone ("outside environment") and installs this release's pins here.
		"$venv/bin/pip" install -q "$requirement" datasets accelerate 2>&1 | grep -v "outside environment" || true
		if [ "$version" = "${NEWEST:-}" ]; then # the newest releases of the libraries whose internals are used
			"$venv/bin/pip" install -q -U accelerate peft 2>&1 | grep -v "outside environment" || true
		fi
		"$venv/bin/python" -c "from importlib.metadata import version; import sys; name, wanted = '$requirement'.split('=='); sys.exit(version(name) != wanted)"
		touch "$venv/.installed"
	fi
	echo "=== $requirement ==="
	start=$(date +%s)
	# shellcheck disable=SC2086
	if HF_HUB_OFFLINE=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider $CORE_TESTS; then
		result=passed
	else
		result=FAILED
		status=1
	fi
	libraries=$("$venv/bin/python" -c 'import importlib.metadata as m, importlib.util as u
print(", ".join(f"{n} {m.version(n)}" for n in ("accelerate", "peft") if u.find_spec(n)))')
	summary+=("$requirement ($libraries): $result ($(($(date +%s) - start)) s)")
done
printf '%s\n' "${summary[@]}"
exit $status
