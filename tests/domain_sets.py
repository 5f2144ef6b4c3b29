"""The bundled domains as the tests use them: the demo profile's set (pedestrian, vehicle)."""

from models.backends.slot_layout import slot_layout
from models.domains import load_domains

DOMAINS = load_domains(["pedestrian", "vehicle"])
LAYOUT = slot_layout(DOMAINS)
