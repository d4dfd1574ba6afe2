"""What the tests share: tiny runs, shards written for the purpose, reference math, process worlds."""
