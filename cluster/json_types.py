"""JSON documents as the gateway, the engines and the tools decode and encode them (request bodies,
status pages, the lab's dashboard answers, provider frames, Kubernetes manifests).

``json.loads``, ``aiohttp``'s and ``httpx``'s ``.json()`` return ``Any``, and a recursive JSON
type would need an ``isinstance`` at every key read: these aliases keep that one foreign ``Any``
under a name that says what the value is, with the reason written once, here.
"""

from __future__ import annotations

from typing import Any

JSON = Any  # a decoded JSON value: the decoders type it Any (see the module's text)
JSONObject = dict[str, Any]  # a JSON object, decoded or to be encoded (values: any JSON)
