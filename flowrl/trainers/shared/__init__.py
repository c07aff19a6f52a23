"""What several algorithms build on: the modality bases (`image`, `control`), the final-sample family (`matching`,
`preference`), Flow-GRPO's step trainer (`flow_grpo`) and the control policies' configs (`policies`). Nothing here
registers a trainer; the algorithms (`image/`, `control/`, `text/`) import these and never each other."""
