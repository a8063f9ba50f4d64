"""`python -m tests.support.probe_main [exit CODE | sleep | raise]`: says what it was started with (argv, folder,
PROBE, whether torch was already imported and transformers' checkpoint renamings already built), then exits with
CODE, sleeps until killed, or raises."""

import json
import os
import sys
import time

print(
    json.dumps(
        {
            "argv": sys.argv[1:],
            "cwd": os.getcwd(),
            "probe": os.environ.get("PROBE"),
            "torch_preloaded": "torch" in sys.modules,
            "renamings_built": getattr(
                sys.modules.get("transformers.conversion_mapping"), "_checkpoint_conversion_mapping_cache", None
            )
            is not None,
            "sid": os.getsid(0),
            "pid": os.getpid(),
        }
    ),
    flush=True,
)
if sys.argv[1:2] == ["exit"]:
    sys.exit(int(sys.argv[2]))
if sys.argv[1:2] == ["raise"]:
    raise ValueError("probe raised")
while sys.argv[1:2] == ["sleep"]:
    time.sleep(1)
