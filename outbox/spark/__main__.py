"""``python -m outbox.spark audit …``, and the file to hand to ``spark-submit``.

``spark-submit --master yarn "$(python -c 'import outbox.spark.__main__ as m; print(m.__file__)')" audit …``
runs the same commands as ``outbox spark`` with the cluster's master.
"""

import sys

from outbox.cli import main

if __name__ == "__main__":
    main(["spark", *sys.argv[1:]], prog_name="outbox")  # errors as `outbox`'s: one `error: …` line
