// The Greeting CustomResourceDefinition, shipped in `describe`: `capstan crd` prints it
// and `capstan run --install-crds` applies it.

export const crd = {
  apiVersion: 'apiextensions.k8s.io/v1',
  kind: 'CustomResourceDefinition',
  metadata: { name: 'greetings.example.com' },
  spec: {
    group: 'example.com',
    scope: 'Namespaced',
    names: { kind: 'Greeting', listKind: 'GreetingList', plural: 'greetings', singular: 'greeting' },
    versions: [
      {
        name: 'v1',
        served: true,
        storage: true,
        subresources: { status: {} },
        additionalPrinterColumns: [
          { name: 'Message', type: 'string', jsonPath: '.spec.message' },
          { name: 'Phase', type: 'string', jsonPath: '.status.phase' },
        ],
        schema: {
          openAPIV3Schema: {
            type: 'object',
            properties: {
              spec: {
                type: 'object',
                required: ['message'],
                properties: {
                  message: { type: 'string', minLength: 1, description: 'What to say, such as Hello.' },
                  audience: {
                    type: 'array',
                    maxItems: 100,
                    items: { type: 'string', minLength: 1 },
                    description: 'Whom to greet, one line each (default: world).',
                  },
                  shout: { type: 'boolean', description: 'Upper-case every line.' },
                },
              },
              status: {
                type: 'object',
                properties: {
                  phase: { type: 'string' },
                  configMap: { type: 'string' },
                  lines: { type: 'integer' },
                  observedGeneration: { type: 'integer', format: 'int64' },
                  conditions: {
                    type: 'array',
                    'x-kubernetes-list-type': 'map',
                    'x-kubernetes-list-map-keys': ['type'],
                    items: {
                      type: 'object',
                      required: ['type', 'status', 'lastTransitionTime', 'reason', 'message'],
                      properties: {
                        type: { type: 'string' },
                        status: { type: 'string', enum: ['True', 'False', 'Unknown'] },
                        observedGeneration: { type: 'integer', format: 'int64' },
                        lastTransitionTime: { type: 'string', format: 'date-time' },
                        reason: { type: 'string' },
                        message: { type: 'string' },
                      },
                    },
                  },
                },
              },
            },
          },
        },
      },
    ],
  },
};
