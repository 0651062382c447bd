"""The .pps strategy language (installed as `piper.dsl`)."""
