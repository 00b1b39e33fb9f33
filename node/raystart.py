"""`ray start` without Ray Client: `python -m segctl.node.raystart start ARGS`.

A Ray head starts a Ray Client server (port 10001, bound to whichever address Ray
picks) whenever the Python package grpcio can be imported, as it can beside the
tracker extras (tensorboard brings it). segctl never uses Ray Client, and one
more listening port on the fleet's network is one more door. This hides grpcio
from the `ray start` process alone, so it starts no client server, exactly as
where grpcio is not installed; the processes it starts (GCS, raylet, workers)
are separate and unaffected.
"""

import sys

sys.modules["grpc"] = None   # type: ignore[assignment]  # `import grpc` now fails here, as where it is not installed

from ray.scripts.scripts import main  # noqa: E402

if __name__ == "__main__":
    sys.argv[0] = "ray"
    main()
