"""`python -m kungfu.torch.build`: builds the torch extension ahead of time
(otherwise the first `import kungfu.torch` does)."""

from ._ext import build

if __name__ == "__main__":
    print(build(verbose=True))
