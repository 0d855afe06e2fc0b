"""The bits of `horovod.common` that scripts import."""
