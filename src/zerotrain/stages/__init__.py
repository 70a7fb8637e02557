"""ZeRO stages. ``stages.factory.build_stage`` picks one; ``stages.protocol`` says what they do."""
