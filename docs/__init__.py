"""The pages `piper explain CODE` prints: codes/CODE.md, installed as the package data of `piper.docs`."""
