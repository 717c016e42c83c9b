"""Hidden-state alignment between the path that captures EAGLE-3 training features and the path that
serves them: extractors with explicit provenance, per-layer comparison, and cause diagnosis."""
