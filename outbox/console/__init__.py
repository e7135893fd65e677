"""The web console: what is stuck, and the operator actions on it, in a browser.

``create_app`` builds a Starlette app; ``outbox console`` serves it, or mount
it in your own ASGI app; ``create_tenants_app`` is one console over many tenants. Needs the ``console`` extra
(``pip install "transactional-outbox[console]"``). See docs/operations.md.
"""

try:
    import jinja2  # noqa: F401
    import python_multipart  # noqa: F401
    import starlette  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(f"the outbox console needs its extra: pip install "
                      f"'transactional-outbox[console]' ({exc})") from exc

from ._app import create_app
from ._auth import Operators
from ._tenants import create_tenants_app

__all__ = ["Operators", "create_app", "create_tenants_app"]
