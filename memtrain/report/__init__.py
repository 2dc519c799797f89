"""Run folders -> one tidy DataFrame -> tables and figures. Never imports torch."""
