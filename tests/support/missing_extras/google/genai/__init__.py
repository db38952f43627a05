"""Stands in for an uninstalled `google-genai` (the `threadline[google]` extra) in worker processes
whose PYTHONPATH starts with `tests/support/missing_extras`: importing it fails the way a missing
package does. `google` stays a namespace package, so the rest of `google.*` still resolves."""

raise ImportError("No module named 'google.genai' (stub: the threadline[google] extra is not installed)")
