#!/usr/bin/env bash
# Installs the npm packages that scripts/validate-deploy.sh uses (pinned in
# deploy/validate/package-lock.json) into deploy/validate/node_modules.
# Node and npm come from scripts/install-deps.sh. Called by scripts/setup.sh.
# Idempotent: skips npm when node_modules was installed from this very
# package-lock.json (its SHA-256 is kept in node_modules/.moe-ep-lock.sha256).
set -euo pipefail
cd "$(dirname "$0")/../deploy/validate"
stamp=node_modules/.moe-ep-lock.sha256
want=$(sha256sum package-lock.json | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "install-deploy-tools: npm packages of deploy/validate are installed"
  exit 0
fi
npm ci --no-audit --no-fund --loglevel=error
echo "$want" > "$stamp"
