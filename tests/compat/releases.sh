#!/usr/bin/env bash
# The transformers releases test-compat-all covers: the first 5.x release, the newest patch of every 5.x
# minor release, and the newest 4.57 patch; read from the package index, so new releases join by themselves.
set -euo pipefail
python3 -m pip index versions transformers 2>/dev/null | sed -n 's/^Available versions: //p' | tr -d ' ' | tr ',' '\n' |
	awk -F. '$1 == 5 || ($1 == 4 && $2 == 57) { minor = $1 "." $2; if (!(minor in seen)) { seen[minor] = $0; order[++n] = minor } }
		END { print "5.0.0"; for (i = n; i >= 1; i--) if (seen[order[i]] != "5.0.0") print seen[order[i]] }'
