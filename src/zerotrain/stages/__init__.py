"""ZeRO stages. ``stages.factory.build_stage`` picks one; ``stages.base`` says what they do."""
