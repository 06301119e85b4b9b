"""Reading compiled programs: bytes on the wire, the HLO, memory and overlap."""
