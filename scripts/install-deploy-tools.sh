#!/usr/bin/env bash
# Installs the npm packages that scripts/validate-deploy.sh uses (pinned in
# deploy/validate/package-lock.json) into deploy/validate/node_modules.
# Node and npm come from scripts/install-deps.sh. Called by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/../deploy/validate"
npm ci --no-audit --no-fund --loglevel=error
