"""The standard library of strategies, one .pps file each (installed as `piper.stdlib`)."""
