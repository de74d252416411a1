"""Settings: package config, site profiles, presets and the vLLM flags they may carry (YAML in, checked values out)."""
